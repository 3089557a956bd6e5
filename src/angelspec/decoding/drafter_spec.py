"""The one grammar of drafter specs: `--drafter SPEC` of every decoding command and the SPEC of `angelspec bench
--config NAME=SPEC[@POLICY][+gate][+compile]`, parsed once into typed values (`DrafterSpec`, `BenchEntry`) that
the library takes. Parsing reads no files: whether a folder exists and what it holds is checked where the drafter
is loaded (`loading.resolve_drafter`).

    SPEC     := none | ngram[:N] | KIND:DIR | DIR | SPEC+ngram[:N[:M[:D]]]
    ENTRY    := NAME=SPEC[@POLICY][+gate][+compile]      (the suffixes in either order)

KIND is a drafter family with a saved form (`drafters.families`); a bare DIR names its kind in its config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from angelspec.decoding.limits import MAX_NGRAM
from angelspec.errors import UsageError

NONE = "none"
NGRAM = "ngram"
DEFAULT_MAX_NGRAM = 3  # ngram's N when not given: the longest n-gram the lookup matches
HYBRID_SUFFIX = "+ngram"  # SPEC+ngram[:N[:M[:D]]]: n-gram lookup in front of a model drafter (`HybridDrafter`)
HYBRID_FORM = f"SPEC{HYBRID_SUFFIX}[:N[:M[:D]]]"
GATE_SUFFIX = "+gate"  # NAME=SPEC[@POLICY]+gate: the speculation gate on
COMPILE_SUFFIX = "+compile"  # NAME=SPEC[@POLICY]+compile: the engine's torch.compile on (EngineConfig.compile)


@dataclass(frozen=True)
class LookupSpec:
    """`+ngram[:N[:M[:D]]]`: the longest n-gram N to match, the shortest match M whose drafts replace the model's,
    and the most drafts D the model proposes in a round (None: the engine's K, as the lookup)."""

    max_ngram: int = DEFAULT_MAX_NGRAM
    min_match: int = 1
    model_depth: int | None = None

    def as_tuple(self) -> tuple[int, int, int | None]:
        return self.max_ngram, self.min_match, self.model_depth


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter spec.

    text: the spec as given (what messages and result files name).
    kind: "none" (plain autoregressive decoding), "ngram" (prompt lookup), a family name (`KIND:DIR`), or None (a bare
        DIR whose config.json names its kind).
    folder: the saved drafter's folder (`KIND:DIR`, `DIR`), None for none and ngram.
    max_ngram: ngram's N.
    lookup: the n-gram lookup put in front of the model drafter (`+ngram`), None without one; the fields above then
        describe the model drafter.
    """

    text: str
    kind: str | None
    folder: Path | None = None
    max_ngram: int = DEFAULT_MAX_NGRAM
    lookup: LookupSpec | None = None

    @property
    def is_none(self) -> bool:
        return self.kind == NONE

    @property
    def base(self) -> str:
        """The model drafter's part of `text` (all of it without `+ngram`)."""
        return split_hybrid_spec(self.text)[0]


def parse_drafter_spec(text: str | DrafterSpec | None) -> DrafterSpec:
    """`--drafter SPEC` -> DrafterSpec (None: `none`); UsageError naming the problem and the valid forms."""
    if isinstance(text, DrafterSpec):
        return text
    if text is None or text == NONE:
        return DrafterSpec(NONE, NONE)
    base, lookup = split_hybrid_spec(text)
    if lookup is not None:
        inner = parse_drafter_spec(base)
        if inner.kind in (NONE, NGRAM):
            raise UsageError(f"drafter {text!r}: {HYBRID_SUFFIX} puts n-gram lookup in front of a model drafter, "
                             f"e.g. dfly:DIR{HYBRID_SUFFIX}; for lookup alone pass ngram")
        return DrafterSpec(text, inner.kind, inner.folder, inner.max_ngram, LookupSpec(*lookup))
    from angelspec.decoding.drafters.families import families

    kind, sep, arg = text.partition(":")
    if kind == NGRAM:
        return DrafterSpec(text, NGRAM, max_ngram=ngram_size(text, arg) if sep else DEFAULT_MAX_NGRAM)
    if kind in {f.name for f in families()}:
        if not sep or not arg:
            raise UsageError(f"drafter {text!r} needs the folder it was saved in: {kind}:DIR; "
                             f"valid forms: {drafter_forms()}")
        return DrafterSpec(text, kind, Path(arg))
    return DrafterSpec(text, None, Path(text))


def split_hybrid_spec(spec: str) -> tuple[str, tuple[int, int, int | None] | None]:
    """`SPEC+ngram[:N[:M[:D]]]` -> (SPEC, (N, M, D)): the longest n-gram N to match (default 3), the shortest match M
    whose drafts replace the model's (default 1) and the most drafts D the model proposes in a round (default None:
    the engine's K, as the lookup); any other spec -> (spec, None)."""
    base, plus, tail = spec.rpartition(HYBRID_SUFFIX)
    if not plus or (tail and not tail.startswith(":")):
        return spec, None
    parts = tail[1:].split(":") if tail else []
    if len(parts) > 3:
        raise UsageError(f"drafter {spec!r}: expected {HYBRID_FORM} (N the longest n-gram to match, M the shortest "
                         "match that replaces the model's drafts, D the most drafts the model proposes in a round)")
    n = ngram_size(spec, parts[0]) if parts else DEFAULT_MAX_NGRAM
    m = ngram_size(spec, parts[1], what=f"{HYBRID_SUFFIX}:N:M needs a positive integer M (the shortest match that "
                   "replaces the model's drafts)") if len(parts) >= 2 else 1
    d = ngram_size(spec, parts[2], what=f"{HYBRID_SUFFIX}:N:M:D needs a positive integer D (the most drafts the "
                   "model proposes in a round)") if len(parts) == 3 else None
    return base, (n, m, d)


def ngram_size(spec: str, arg: str,
               what: str = "ngram:N needs a positive integer N (the longest n-gram to match)") -> int:
    try:
        n = int(arg)
    except ValueError:
        n = 0
    if n < 1:
        raise UsageError(f"drafter {spec!r}: {what}, got {arg!r}")
    if n > MAX_NGRAM:
        raise UsageError(f"drafter {spec!r}: {what.partition(' needs ')[0]} must be at least 1 and at most "
                         f"{MAX_NGRAM}, got {n}")
    return n


def drafter_forms(include_none: bool = True) -> str:
    """The valid `--drafter` forms, with the saved-drafter kinds read from the family records."""
    from angelspec.decoding.drafters.families import families

    saved = ", ".join(f"{f.name}:DIR" for f in families() if f.saved)
    none = "none, " if include_none else ""
    return f"{none}ngram, ngram:N (longest n-gram to match, default 3), {saved}, or DIR (a folder written by " \
           f"`angelspec train`); a model drafter's {HYBRID_FORM} puts n-gram lookup in front of it"


@dataclass(frozen=True)
class BenchEntry:
    """One `angelspec bench --config NAME=SPEC[@POLICY][+gate][+compile]`: the curve's name, its drafter spec (kept
    as text: `parse_drafter_spec` reads it when the drafter is loaded), the depth-policy spec as text (the policy
    factory owns that grammar; None when the entry names none, so the sweep picks its default), and the two
    switches."""

    name: str
    drafter: str
    policy: str | None = None
    spec_gate: bool = False
    compile: bool = False


def parse_bench_entry(text: str) -> BenchEntry:
    """`NAME=SPEC[@POLICY][+gate][+compile]` -> BenchEntry (SPEC `none` for AR; POLICY None when not given;
    `+gate` turns the speculation gate on, `+compile` the engine's torch.compile, in either order). Syntax only:
    UsageError naming the expected form; the policy and the drafter are checked by their own parsers."""
    name, sep, rest = text.partition("=")
    name, rest = name.strip(), rest.strip()
    suffixes = set()
    while found := next((x for x in (GATE_SUFFIX, COMPILE_SUFFIX) if rest.endswith(x)), None):
        suffixes.add(found)
        rest = rest.removesuffix(found).strip()
    gate = GATE_SUFFIX in suffixes
    if not sep or not name or not rest:
        raise UsageError(f"--config {text!r}: expected NAME=SPEC[@POLICY], e.g. AR=none, DFly=dfly:DIR or "
                         "DFly+D-cut=dfly:DIR@dcut")
    spec, at, policy = rest.rpartition("@")
    if not at:
        spec, policy = rest, None
    if not spec.strip():
        raise UsageError(f"--config {text!r}: the drafter SPEC before '@' is empty; expected NAME=SPEC[@POLICY]")
    entry = BenchEntry(name=name, drafter=spec.strip(), policy=None if policy is None else policy.strip(),
                       spec_gate=gate,
                       compile=COMPILE_SUFFIX in suffixes)
    if gate and entry.drafter == NONE:
        raise UsageError(f"--config {text!r}: +gate decides when to draft, but AR (drafter none) never drafts")
    return entry
