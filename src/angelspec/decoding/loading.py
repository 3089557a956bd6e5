"""Loaders every layer above `decoding/` shares: a target with its tokenizer, prompts rendered with its chat
template, a `--drafter` spec turned into a drafter (through the registry), and one batched engine run.

The command line, the demo, the benchmarks and the evaluation code all call these; nothing here parses
arguments or prints.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from angelspec.decoding.drafter_spec import (
    NGRAM,
    DrafterSpec,
    LookupSpec,
    drafter_forms,
    parse_drafter_spec,
)
from angelspec.errors import UsageError

if TYPE_CHECKING:
    import torch

    from angelspec.decoding.drafters.base import Drafter
    from angelspec.models import Decoder
    from angelspec.models.device import Placement


def load_target_and_tokenizer(target_dir: Path, placement: Placement | None = None) -> tuple[Decoder, Any]:
    """Load the target's weights and its tokenizer from one HF-layout folder, on `placement`'s device in its dtype
    (None: `angelspec.models.device.resolve_placement()`, a GPU in bfloat16 where torch sees one, else the CPU in
    float32).

    The config and the tokenizer are read first so an unknown architecture or a missing file fails
    before the weights are read; the tokenizer must sit beside the weights because prompts are rendered
    with its chat template.
    """
    from angelspec.data.tokenizer import TokenizerError, load_tokenizer
    from angelspec.models import load_target, read_config
    from angelspec.models.device import placement_of

    config = read_config(target_dir)
    try:
        tokenizer = load_tokenizer(target_dir)
    except TokenizerError as e:
        raise UsageError(f"cannot load the target's tokenizer: {e} (the target folder needs a Hugging Face fast "
                         "tokenizer beside the weights: tokenizer.json and tokenizer_config.json, with the chat "
                         "template in tokenizer_config.json or chat_template.jinja)") from None
    ends = config.eos_token_ids or tuple(tokenizer.eos_token_ids)
    if not ends:
        raise UsageError(f"{target_dir}: config.json has no eos_token_id and the tokenizer names no end token, so "
                         "generation would never stop at the end of a reply; add \"eos_token_id\": ID (the "
                         "end-of-turn token's id) to config.json")
    where = placement_of(placement)
    where.use_attention()
    model = load_target(target_dir, dtype=where.dtype, device=where.device)
    if not config.eos_token_ids:  # the tokenizer knows the end tokens config.json (and the files beside it) lack
        import dataclasses

        model.config = dataclasses.replace(model.config, eos_token_id=list(ends))
    if tokenizer.vocab_size > config.vocab_size:
        raise UsageError(f"{target_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
                         f"is {config.vocab_size}; the tokenizer files belong to another model")
    return model, tokenizer


def encode_prompts(tokenizer: Any, prompts: list[dict[str, Any]], *, context: int, think: bool,
                   source: str) -> list[list[int]]:
    """Render each prompt's messages with the chat template; refuse prompts that leave no room to generate."""
    encoded = [tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, enable_thinking=think)
               for p in prompts]
    too_long = [(p["line"], len(ids)) for p, ids in zip(prompts, encoded, strict=True) if len(ids) >= context]
    if too_long:
        line, n = too_long[0]
        more = f" ({len(too_long) - 1} more lines are too long)" if len(too_long) > 1 else ""
        raise UsageError(f"{source}:{line}: the prompt is {n} tokens after the chat template, but the target's "
                         f"context is {context} tokens, so no token can be generated{more}")
    return encoded


def run_engine(model: Decoder, prompt_ids: list[list[int]], *, max_new_tokens: int, sampling: list[Any],
               batch_size: int, drafter: Drafter | None = None, num_draft_tokens: int = 4,
               progress: bool = True, depth_policy: Any = None, spec_gate: bool = False,
               compile: bool = False) -> tuple[list[Any], Any]:
    """Generate for every prompt through the engine; returns the results (in prompt order) and the run's
    `DecodeMetrics` (tokens/s, steps, and acceptance once a drafter is used). depth_policy: drafts each row
    verifies (`angelspec.decoding.policies.factory.make_policy`); None = all K. spec_gate: skip drafting where
    plain steps are faster (`EngineConfig.spec_gate`); compile: `EngineConfig.compile`.

    Each request's budget is capped so prompt + completion fits the context; such rows end with
    finish_reason "length" like any other that ran out of tokens.
    """
    from angelspec.decoding.engine import EngineConfig, Request, SpecEngine

    context = model.config.max_position_embeddings
    engine = SpecEngine(model, drafter=drafter,
                        config=EngineConfig(max_batch_size=batch_size, num_draft_tokens=num_draft_tokens,
                                            spec_gate=spec_gate and drafter is not None, compile=compile),
                        depth_policy=depth_policy)
    requests = [Request(prompt_ids=ids, max_new_tokens=min(max_new_tokens, context - len(ids)), sampling=s,
                        request_id=i)
                for i, (ids, s) in enumerate(zip(prompt_ids, sampling, strict=True))]
    results = engine.generate(requests, progress=progress)
    return results, engine.metrics


def resolve_drafter(spec: str | DrafterSpec | None, target: Decoder, target_dir: Path,
                    dtype: torch.dtype | None = None) -> Drafter | None:
    """Turn `--drafter SPEC` (text, parsed by `drafter_spec.parse_drafter_spec`, or parsed already) into a drafter for
    the engine (None = plain autoregressive decoding).

    Forms: `none`; `ngram` or `ngram:N` (prompt lookup, longest n-gram N, default 3); `KIND:DIR` (a saved
    drafter of a registered kind, e.g. `draft-lm:DIR`, which also accepts any HF causal LM that shares the
    target's tokenizer); a bare `DIR` written by `angelspec train`, whose config.json names its kind in
    `"angelspec": {"drafter": KIND}`; `SPEC+ngram[:N[:M[:D]]]`. Saved drafters load through their family record's
    `load` (a draft LM has its own weights in `dtype` on the target's device, an MTP head shares the target's
    embedding), so a new drafter kind needs no change here. The drafter is checked against the
    target before it is returned: a drafter for another target fails here, before any decoding.
    """
    from angelspec.decoding.drafters.base import DrafterMismatchError
    from angelspec.decoding.drafters.ngram import NGramDrafter

    parsed = parse_drafter_spec(spec)
    if parsed.is_none:
        return None
    if parsed.lookup is not None:
        return _hybrid(parsed.text, resolve_drafter(parsed.base, target, target_dir, dtype), parsed.lookup)
    text = parsed.text
    dtype = dtype or target.embed_tokens.weight.dtype
    drafter: Drafter
    try:
        if parsed.kind == NGRAM:
            drafter = NGramDrafter(max_ngram=parsed.max_ngram)
        elif parsed.kind is not None or parsed.folder.exists():
            drafter = _load_saved_drafter(text, parsed.folder, parsed.kind, target, dtype)
        else:
            kind, sep, _ = text.partition(":")
            what = f"{kind!r} is not a drafter kind" if sep else "not a drafter name, and no such directory"
            raise UsageError(f"unknown drafter {text!r} ({what}); valid forms: {drafter_forms()}")
        drafter.check_compatible(target.config)
    except DrafterMismatchError as e:
        raise DrafterMismatchError(f"drafter {text!r} does not fit the target {target_dir}: {e}") from None
    return drafter


def target_weights_id(target_dir: str | Path, target: Decoder | None = None) -> str:
    """The one id of a target's weights that every command records and compares (drafters, resumed runs,
    `--init-from`, exports, imports, rollouts, feature caches): `data.fingerprint.target_weights_fingerprint`, the
    same for a float32 and a bfloat16 load. `target`: the loaded model, whose tensors left on the meta device (a
    `parts="head"` load) are read from `target_dir` one at a time; None: nothing is loaded, every tensor is read
    from `target_dir` that way (an export or an import, which never runs the target)."""
    import torch

    from angelspec.data.fingerprint import target_weights_fingerprint
    from angelspec.models.hf_io import iter_state_dict, load_target

    if target is None:
        target = load_target(target_dir, dtype=torch.bfloat16, device="meta")  # the layout alone
    if all(t.device.type != "meta" for t in target.state_dict().values()):
        return target_weights_fingerprint(target)
    return target_weights_fingerprint(target, iter_state_dict(target, target_dir))


def other_weights(recorded: Any, have: str | Callable[[], str]) -> str | None:
    """What is wrong when a folder records the weights of the target it was made for (`recorded`, a
    `"target_weights"` entry; anything but a string is no record: a folder written before the weights were
    recorded, checked on its config fingerprint alone) and the target at hand has `have` (its `target_weights_id`,
    or a callable computing it only when there is a record): None when they agree, else "weights fingerprint
    RECORDED, but this target's weights have HAVE (...)", for the caller to put after "made for a target with "."""
    if not isinstance(recorded, str):
        return None
    have = have() if callable(have) else have
    if have == recorded:
        return None
    return (f"weights fingerprint {recorded}, but this target's weights have {have} (same shape, other weights: a "
            "retrained or fine-tuned model)")


def check_target_weights(spec: str, path: Path, meta: Any, target: Decoder) -> None:
    """DrafterMismatchError when the drafter folder's config.json records the weights of the target it was trained
    for (`"angelspec": {"target_weights": ...}`, `target_weights_id`) and `target` has other weights: a retrained or
    fine-tuned target of the same shape, which the config fingerprint cannot tell (`other_weights`)."""
    from angelspec.data.fingerprint import target_weights_fingerprint
    from angelspec.decoding.drafters.base import DrafterMismatchError

    recorded = meta.get("target_weights") if isinstance(meta, dict) else None
    if any(t.device.type == "meta" for t in target.state_dict().values()):
        return  # a target without weights (a layout on `meta`): nothing to compare
    problem = other_weights(recorded, lambda: target_weights_fingerprint(target))
    if problem is not None:
        raise DrafterMismatchError(f"{path} was trained for a target with {problem}; pass --target with the "
                                   "drafter's own target, or train a drafter for this one")


def draft_depth(drafter: Drafter | None, requested: int | None = None) -> int:
    """The K a command drafts with: `requested` (`--num-draft-tokens`) when given, else the depth the drafter was
    trained for (`Drafter.trained_depth`: a block drafter's block size - 1, an MTP / EAGLE-3 model's depth count),
    else its family's `default_depth` (`DEFAULT_NUM_DRAFT_TOKENS` for a drafter of no family). A requested K is
    checked by `limits.check_num_draft_tokens`."""
    from angelspec.decoding.drafters.families import DEFAULT_NUM_DRAFT_TOKENS, family_of
    from angelspec.decoding.limits import check_num_draft_tokens

    if requested is not None:
        check_num_draft_tokens(requested)
        return requested
    if drafter is None:
        return DEFAULT_NUM_DRAFT_TOKENS
    trained = drafter.trained_depth
    if isinstance(trained, int) and trained > 0:
        return trained
    family = family_of(drafter)
    return DEFAULT_NUM_DRAFT_TOKENS if family is None else family.default_depth


def _hybrid(spec: str, inner: Drafter | None, lookup: LookupSpec) -> Drafter:
    from angelspec.decoding.drafters.hybrid import HybridDrafter
    from angelspec.decoding.drafters.ngram import NGramDrafter

    assert inner is not None  # parse_drafter_spec refuses none+ngram and ngram+ngram
    max_ngram, min_match, model_depth = lookup.as_tuple()
    try:
        return HybridDrafter(inner, NGramDrafter(max_ngram=max_ngram), min_match=min_match, model_depth=model_depth)
    except ValueError as e:
        raise UsageError(f"drafter {spec!r}: {e}") from None


def drafter_path(spec: str | DrafterSpec) -> Path:
    """The folder a saved-drafter `--drafter` spec names (DIR of KIND:DIR or of DIR, else the spec itself); its
    existence is not checked."""
    parsed = parse_drafter_spec(spec)
    return parsed.folder if parsed.folder is not None else Path(parsed.base)


def _load_saved_drafter(spec: str, path: Path, kind: str | None, target: Decoder, dtype: torch.dtype) -> Drafter:
    """Load a drafter folder. `kind` None = read it from config.json's `"angelspec": {"drafter": ...}`.
    A `calibration.json` in the folder (from `angelspec calibrate`) wraps it in a `CalibratedDrafter`."""
    from angelspec.decoding.drafters.families import families, get_family

    known = tuple(f.name for f in families())
    if not path.is_dir():
        problem = "is a file, not a folder" if path.exists() else "does not exist"
        raise UsageError(f"drafter {spec!r}: {path} {problem}; valid forms: {drafter_forms()}")
    config = path / "config.json"
    if not config.is_file():
        raise UsageError(f"drafter {spec!r}: {path} is not a drafter folder (no config.json); "
                         f"valid forms: {drafter_forms()}")
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"drafter {spec!r}: {config} is not valid JSON ({e})") from None
    meta = raw.get("angelspec") if isinstance(raw, dict) else None
    recorded = meta.get("drafter") if isinstance(meta, dict) else None
    if kind is None:
        if not isinstance(recorded, str):
            raise UsageError(f'drafter {spec!r}: {path} is not an AngelSpec drafter folder (its config.json has no '
                             f'"angelspec": {{"drafter": ...}} entry); to use a plain HF causal LM that shares the '
                             f"target's tokenizer as a draft model, pass draft-lm:{path}")
        if recorded not in known:
            raise UsageError(f"drafter {spec!r}: {path} holds a {recorded!r} drafter, which this version of AngelSpec "
                             f"cannot load (known kinds: {', '.join(known)})")
        kind = recorded
    elif recorded is not None and recorded != kind:
        raise UsageError(f"drafter {spec!r}: {path} holds a {recorded!r} drafter, not {kind!r}; "
                         f"pass --drafter {path} (or {recorded}:{path})")
    check_target_weights(spec, path, meta, target)
    family = get_family(kind)
    if not family.saved:
        raise UsageError(f"drafter {spec!r}: {kind!r} drafters are built from settings and have no saved form; "
                         f"valid forms: {drafter_forms()}")
    from angelspec.decoding.drafters.calibrated import with_calibration

    assert family.load is not None
    drafter = family.load(path, target, dtype)
    return with_calibration(drafter, path)  # a calibration.json beside the weights calibrates its confidences
