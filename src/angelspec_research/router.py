"""Workload routing (beyond the report): pick the drafter per request — MTP for chat, DFly for code and maths.

The report's Tables 3–4 show that no single drafter wins every domain: block-parallel drafters (DFly) gain most on
structured code and maths, while MTP stays competitive on open-ended chat at a lower drafting cost. A router that
sends each request to the drafter that serves its domain best can therefore beat the best single drafter on a
mixed workload. Three pieces:

* `classify_prompt(text)`: cheap regex heuristics on the prompt text -> "code" | "math" | "chat" (code markers:
  back-quoted identifiers and calls next to programming words; maths markers: several numbers next to a question
  or an equation; everything else is chat). `classifier_accuracy` measures it against labelled prompts (the
  shipped `assets/prompts/eval.jsonl` carries a `domain` per line).
* `WorkloadRouter`: a static rule (domain -> drafter, `STATIC_RULE`) and, when `online`, an acceptance tracker
  that keeps per (domain, drafter) running MAL and tokens/s from finished requests (`ArmStats`) and routes each
  new request to the drafter with the best measured tokens/s for its domain, after an exploration phase in which
  every drafter is tried on the first `explore` requests of each domain. Until a domain has measurements for
  every drafter the static rule decides (the prior).
* `route_and_generate(target, drafters, requests, router=...)`: request-level routing, as in a deployment where
  each drafter is its own server pool: requests are routed in waves, each wave's requests are grouped by the
  drafter chosen for them and every group runs through that drafter's own `SpecEngine`; the finished requests
  feed the tracker before the next wave is routed. Results come back in request order with a `RoutedRun`
  summary per drafter and per domain.

Lossless by construction: every engine is lossless, and a request's output does not depend on which other
requests share its batch (the engine's randomness is keyed per request and position), so at T=0 each routed
output equals plain autoregressive decoding whichever drafter served it.

Tokens/s bookkeeping: a group's engine wall-clock is attributed to its requests in proportion to their target
forwards (`Result.num_steps`), so a (domain, drafter) arm's tokens/s is its tokens over its share of the wall-clock
(throughput, not per-user latency; independent of how many requests shared the batch when the step cost is
compute-bound). On one machine the pools run one after the other, so a run's overall tokens/s is all tokens over
the summed wall-clock of its groups.

Shape legend: none (host-side bookkeeping; tensors live in the engines).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from angelspec.decoding.drafters.base import Drafter
from angelspec.decoding.engine import EngineConfig, Request, Result, SpecEngine
from angelspec.models.decoder import Decoder

DOMAINS = ("code", "math", "chat")
# The report's deployment split (§3.4–3.5): DFly as the code/maths drafter, MTP for open-ended chat.
STATIC_RULE: dict[str, str] = {"code": "dfly", "math": "dfly", "chat": "mtp"}


class RouterError(ValueError):
    """A router or routed run that cannot work as configured (unknown drafter names, missing prompt texts...)."""


# --------------------------------------------------------------------------------------------------------------
# (a) Prompt classifier
# --------------------------------------------------------------------------------------------------------------

# A back-quoted identifier, attribute path or call: `foo`, `a.b_c`, `f(x, y=1)`.
_BACKTICK_CODE = re.compile(r"`[A-Za-z_][\w.]*(\([^`]*\))?`")
_CODE_WORDS = re.compile(r"\b(method|function|module|class|signature|implement|source|python|def|return|import|"
                         r"code|script|program)\b", re.IGNORECASE)
# Code written out in the prompt: a Python/C-like line, a block opener, an include, SQL.
_CODE_LINES = re.compile(r"(^|\n)\s*(def |class |import |from \S+ import |#include|public |SELECT |for \(|"
                         r"return |const |let |function )|[{};]\s*\n", re.IGNORECASE)
_URL = re.compile(r"https?://\S+|www\.\S+")
MATH_MAX_CHARS = 400
_NUMBER = re.compile(r"(?<![\w.])\$?\d+(?:[.,]\d+)?%?")
_MATH_CUES = re.compile(r"\b(how (many|much|far|old|long)|what is (my|the) (number|total|sale price|larger)|"
                        r"solve|percentage|percent|total|each|left over|equally|times as|per hour|sum|"
                        r"product|difference|average|remainder|result)\b|[=+*/^%$]", re.IGNORECASE)


def domain_scores(text: str) -> dict[str, float]:
    """Heuristic evidence per domain for one prompt's text: {"code": s, "math": s, "chat": 0.5}. Chat is the
    fallback: a domain wins only with more evidence than chat's constant."""
    code = 2.0 * len(_BACKTICK_CODE.findall(text)) + 2.0 * len(_CODE_LINES.findall(text))
    if code:
        code += 0.5 * len(_CODE_WORDS.findall(text))  # programming words only count next to code markers
    prose = _URL.sub(" ", text)  # links carry digits, "%" and "/" that are not arithmetic
    numbers = len(_NUMBER.findall(prose))
    cues = len(_MATH_CUES.findall(prose))
    math = 0.0
    if numbers >= 2 and cues and len(prose) <= MATH_MAX_CHARS:  # word problems are short; long numeric texts
        math = 1.0 + 0.5 * min(numbers, 6) + 0.5 * min(cues, 4)  # are reports, plans or essays (chat)
    return {"code": code, "math": math, "chat": 0.5}


def classify_prompt(text: str) -> str:
    """"code" | "math" | "chat" for a prompt's text (the user message, or the chat-template rendering of the
    conversation; ties go to the order code > math > chat)."""
    scores = domain_scores(text)
    return max(DOMAINS, key=lambda d: (scores[d], -DOMAINS.index(d)))


def classifier_accuracy(texts: Sequence[str], labels: Sequence[str],
                        classifier: Callable[[str], str] = classify_prompt) -> tuple[float, dict[str, dict[str, int]]]:
    """(accuracy, confusion {true domain: {predicted: count}}) of `classifier` on labelled prompts."""
    if len(texts) != len(labels):
        raise RouterError(f"{len(texts)} prompt texts but {len(labels)} labels: pass one label per prompt")
    if not texts:
        raise RouterError("no labelled prompts to measure the classifier on")
    confusion: dict[str, dict[str, int]] = {}
    hits = 0
    for text, label in zip(texts, labels, strict=True):
        pred = classifier(text)
        confusion.setdefault(label, {}).setdefault(pred, 0)
        confusion[label][pred] += 1
        hits += pred == label
    return hits / len(texts), confusion


# --------------------------------------------------------------------------------------------------------------
# (b) Acceptance tracker and router
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ArmStats:
    """Running totals of finished requests for one (domain, drafter) arm, or any other group of requests."""

    requests: int = 0
    output_tokens: int = 0
    verify_steps: int = 0  # target forwards after the prefill (the prefill emits the first token)
    seconds: float = 0.0  # attributed engine wall-clock

    def add(self, result: Result, seconds: float) -> None:
        self.requests += 1
        self.output_tokens += len(result.token_ids)
        self.verify_steps += result.num_steps - 1
        self.seconds += seconds

    def merge(self, other: ArmStats) -> None:
        self.requests += other.requests
        self.output_tokens += other.output_tokens
        self.verify_steps += other.verify_steps
        self.seconds += other.seconds

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify step (the first token of each request comes from its prefill)."""
        after_prefill = self.output_tokens - self.requests
        return after_prefill / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "output_tokens": self.output_tokens, "verify_steps": self.verify_steps,
                "seconds": round(self.seconds, 4), "mal": round(self.mean_accepted_length, 4),
                "tokens_per_s": round(self.tokens_per_s, 2)}


@dataclass(frozen=True)
class Choice:
    """Where one request went and why: "static" (the rule), "explore" (exploration phase), "measured" (best
    tokens/s so far) or "prior" (online, but measurements for this domain are still incomplete)."""

    domain: str
    drafter: str
    reason: str


class WorkloadRouter:
    """Chooses a drafter per request from its domain: the static `rule`, refined online by measured tokens/s.

    drafters: the names the router may choose (keys of `route_and_generate`'s `drafters`).
    rule: domain -> drafter name (default `STATIC_RULE`); a domain it does not name goes to `drafters[0]`.
    online: route by measured tokens/s per (domain, drafter) once every drafter has been tried `explore` times in
        that domain and has finished requests there; the rule decides before (and always when online is False).
    classifier: text -> domain (default `classify_prompt`).
    """

    def __init__(self, drafters: Sequence[str], *, rule: Mapping[str, str] | None = None, online: bool = False,
                 explore: int = 2, classifier: Callable[[str], str] = classify_prompt) -> None:
        self.drafters = tuple(drafters)
        if not self.drafters or len(set(self.drafters)) != len(self.drafters):
            raise RouterError(f"a router needs one or more distinct drafter names, got {list(drafters)!r}")
        self.rule = dict(STATIC_RULE if rule is None else rule)
        unknown = sorted({d for d in self.rule.values() if d not in self.drafters})
        if unknown:
            raise RouterError(f"the routing rule names drafters {unknown} that the router was not given "
                              f"({list(self.drafters)}): pass a rule over those names (rule={{domain: name}}) or "
                              "add the drafters")
        if isinstance(explore, bool) or not isinstance(explore, int) or explore < 0:
            raise RouterError(f"explore must be an int >= 0 (requests per drafter and domain), got {explore!r}")
        if online and len(self.drafters) > 1 and explore < 1:
            raise RouterError("an online router learns only from drafters it tried: pass explore >= 1 (requests "
                              "per drafter and domain before routing by measurement), or online=False")
        self.online, self.explore, self.classifier = online, explore, classifier
        self.stats: dict[tuple[str, str], ArmStats] = {}
        self._assigned: dict[tuple[str, str], int] = {}  # routed so far, finished or not

    @classmethod
    def fixed(cls, drafter: str) -> WorkloadRouter:
        """Every request to `drafter`: the single-drafter baseline in the same bookkeeping."""
        return cls([drafter], rule=dict.fromkeys(DOMAINS, drafter))

    @property
    def mode(self) -> str:
        if len(self.drafters) == 1:
            return f"fixed:{self.drafters[0]}"
        return f"online(explore={self.explore})" if self.online else "static"

    def prior(self, domain: str) -> str:
        return self.rule.get(domain, self.drafters[0])

    def arm(self, domain: str, drafter: str) -> ArmStats:
        return self.stats.setdefault((domain, drafter), ArmStats())

    def choose(self, domain: str) -> Choice:
        """The drafter for the next request of `domain`; counts it as assigned (call once per request)."""
        prior = self.prior(domain)
        reason = "static"
        pick = prior
        if self.online and len(self.drafters) > 1:
            # Prior first among equally tried drafters, then the given order.
            order = sorted(self.drafters, key=lambda d: (d != prior, self.drafters.index(d)))
            tried = {d: self._assigned.get((domain, d), 0) for d in order}
            under = [d for d in order if tried[d] < self.explore]
            if under:
                pick, reason = min(under, key=lambda d: tried[d]), "explore"
            elif all(self.arm(domain, d).requests for d in order):
                pick = max(order, key=lambda d: self.arm(domain, d).tokens_per_s)
                reason = "measured"
            else:
                reason = "prior"
        self._assigned[(domain, pick)] = self._assigned.get((domain, pick), 0) + 1
        return Choice(domain=domain, drafter=pick, reason=reason)

    def record(self, domain: str, drafter: str, result: Result, seconds: float) -> None:
        """A finished request: its tokens, target forwards and attributed wall-clock seconds."""
        self.arm(domain, drafter).add(result, seconds)

    def table(self) -> str:
        """The tracker's current estimates, one line per (domain, drafter) arm."""
        lines = [f"{'domain':<8}{'drafter':<12}{'requests':>9}{'MAL':>7}{'tok/s':>9}"]
        for (domain, drafter), s in sorted(self.stats.items()):
            lines.append(f"{domain:<8}{drafter:<12}{s.requests:>9}{s.mean_accepted_length:>7.2f}"
                         f"{s.tokens_per_s:>9.1f}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# (c) Routed generation
# --------------------------------------------------------------------------------------------------------------


@dataclass
class RoutedRun:
    """Results of `route_and_generate` in request order, where each request went, and the bookkeeping."""

    results: list[Result]
    choices: list[Choice]
    seconds: list[float]  # per request, its attributed share of its group's engine wall-clock
    per_drafter: dict[str, ArmStats]
    per_domain: dict[str, ArmStats]
    waves: int
    arms: dict[tuple[str, str], ArmStats] = field(default_factory=dict)

    @property
    def overall(self) -> ArmStats:
        out = ArmStats()
        for s in self.per_drafter.values():
            out.merge(s)
        return out

    def stats_by(self, labels: Sequence[str]) -> dict[str, ArmStats]:
        """Totals per label of each request (e.g. the true domains, where `per_domain` keys the routed ones)."""
        if len(labels) != len(self.results):
            raise RouterError(f"{len(labels)} labels for {len(self.results)} requests: pass one per request")
        out: dict[str, ArmStats] = {}
        for label, res, sec in zip(labels, self.results, self.seconds, strict=True):
            out.setdefault(label, ArmStats()).add(res, sec)
        return out

    def routing_table(self) -> dict[str, dict[str, int]]:
        """{domain: {drafter: requests}}."""
        out: dict[str, dict[str, int]] = {}
        for c in self.choices:
            out.setdefault(c.domain, {}).setdefault(c.drafter, 0)
            out[c.domain][c.drafter] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"overall": self.overall.to_dict(), "waves": self.waves,
                "per_drafter": {k: v.to_dict() for k, v in self.per_drafter.items()},
                "per_domain": {k: v.to_dict() for k, v in self.per_domain.items()},
                "routing": self.routing_table(),
                "reasons": {r: sum(c.reason == r for c in self.choices) for r in {c.reason for c in self.choices}}}


def route_and_generate(target: Decoder, drafters: Mapping[str, Drafter], requests: Sequence[Request], *,
                       router: WorkloadRouter, prompt_texts: Sequence[str] | None = None,
                       domains: Sequence[str] | None = None, tokenizer: Any = None,
                       config: EngineConfig | None = None, num_draft_tokens: Mapping[str, int] | None = None,
                       wave_size: int | None = None, warmup_tokens: int = 0) -> RoutedRun:
    """Route every request to a drafter and decode each drafter's group with its own `SpecEngine`.

    drafters: name -> drafter; the router's names must be among them (only the drafters the router may pick are
        built into engines).
    Domains come from `domains` (known labels: an oracle router) or from `router.classifier` applied to
    `prompt_texts`, or to the decoded prompt ids when only a `tokenizer` is given.
    config: the engine settings shared by every pool (max batch, K, ...); `num_draft_tokens` overrides K per
        drafter name (e.g. a block drafter's B−1 next to MTP's K).
    wave_size: requests routed before the tracker sees results (None = all at once, the right choice for a
        static router; an online router needs waves to learn from).
    warmup_tokens: each engine first decodes an untimed batch of this many new tokens per request (0 = none),
        so one-time costs are not billed to whichever pool runs first.
    """
    requests = list(requests)
    n = len(requests)
    missing = [d for d in router.drafters if d not in drafters]
    if missing:
        raise RouterError(f"the router may choose {missing} but no drafter of that name was passed "
                          f"(got {sorted(drafters)}): pass drafters={{name: Drafter}} with every routed name")
    doms = _request_domains(requests, router, prompt_texts, domains, tokenizer)
    if wave_size is not None and (isinstance(wave_size, bool) or not isinstance(wave_size, int) or wave_size < 1):
        raise RouterError(f"wave_size must be an int >= 1 or None (all requests in one wave), got {wave_size!r}")
    config = config or EngineConfig()
    overrides = dict(num_draft_tokens or {})
    engines = {name: SpecEngine(target, drafters[name],
                                replace(config, num_draft_tokens=overrides.get(name, config.num_draft_tokens)))
               for name in router.drafters}  # every drafter is checked against the target before any decoding
    if warmup_tokens > 0 and requests:
        warm = [replace(r, max_new_tokens=min(warmup_tokens, r.max_new_tokens))
                for r in requests[: config.max_batch_size]]
        for engine in engines.values():
            engine.generate(warm)

    results: list[Result | None] = [None] * n
    seconds = [0.0] * n
    choices: list[Choice | None] = [None] * n
    per_drafter = {name: ArmStats() for name in router.drafters}
    per_domain: dict[str, ArmStats] = {}
    arms: dict[tuple[str, str], ArmStats] = {}
    size = wave_size or max(n, 1)
    waves = 0
    for start in range(0, n, size):
        waves += 1
        idx = list(range(start, min(start + size, n)))
        groups: dict[str, list[int]] = {}
        for i in idx:
            choices[i] = c = router.choose(doms[i])
            groups.setdefault(c.drafter, []).append(i)
        for name, members in groups.items():
            engine = engines[name]
            out = engine.generate([requests[i] for i in members])
            wall = engine.metrics.wall_s
            steps = sum(r.num_steps for r in out) or 1
            for i, res in zip(members, out, strict=True):
                sec = wall * res.num_steps / steps  # the group's wall-clock, shared by target forwards
                results[i], seconds[i] = res, sec
                router.record(doms[i], name, res, sec)
                per_drafter[name].add(res, sec)
                per_domain.setdefault(doms[i], ArmStats()).add(res, sec)
                arms.setdefault((doms[i], name), ArmStats()).add(res, sec)
    assert all(r is not None for r in results) and all(c is not None for c in choices)
    return RoutedRun(results=results, choices=choices, seconds=seconds,  # type: ignore[arg-type]
                     per_drafter=per_drafter,
                     per_domain=per_domain, waves=waves, arms=arms)


def _request_domains(requests: list[Request], router: WorkloadRouter, prompt_texts: Sequence[str] | None,
                     domains: Sequence[str] | None, tokenizer: Any) -> list[str]:
    n = len(requests)
    if domains is not None:
        if len(domains) != n:
            raise RouterError(f"{len(domains)} domains for {n} requests: pass one domain per request")
        return list(domains)
    texts: Iterable[str]
    if prompt_texts is not None:
        if len(prompt_texts) != n:
            raise RouterError(f"{len(prompt_texts)} prompt texts for {n} requests: pass one text per request")
        texts = prompt_texts
    elif tokenizer is not None:
        texts = (tokenizer.decode(list(r.prompt_ids)) for r in requests)
    elif len(router.drafters) == 1:
        return ["all"] * n  # a single-drafter router needs no domain
    else:
        raise RouterError("the router needs each request's domain: pass prompt_texts=[...] (the prompts' text), "
                          "a tokenizer to decode the prompt ids, or domains=[...] (known labels)")
    return [router.classifier(t) for t in texts]
