"""Workload router (`spec.router`): the prompt classifier on the shipped held-out prompts, the online tracker's
explore-then-exploit choices, routed generation equal to AR decoding at T=0 on a tiny target, and bad input."""

from __future__ import annotations

import json
import random

import pytest
from test_block_engine import VOCAB, tiny_block_drafter, tiny_target

from angelspec.assets import EVAL_PROMPTS
from angelspec.decoding.drafters.block import DFlyDrafter
from angelspec.decoding.drafters.ngram import NGramDrafter
from angelspec.decoding.engine import EngineConfig, Request, Result, reference_generate
from angelspec_research.router import (
    RouterError,
    WorkloadRouter,
    classifier_accuracy,
    classify_prompt,
    route_and_generate,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_classifier_on_the_shipped_held_out_prompts():
    recs = [json.loads(line) for line in EVAL_PROMPTS.read_text().splitlines() if line.strip()]
    acc, confusion = classifier_accuracy([r["prompt"] for r in recs], [r["domain"] for r in recs])
    assert acc >= 0.9, confusion
    assert classify_prompt("Write the method `proxy(self, *args)` of `PanedWindow`.") == "code"
    assert classify_prompt("Tom buys 7 toy cars for $4 each. How much does Tom spend?") == "math"
    assert classify_prompt("Plan a 12 day trip to greece") == "chat"
    assert classify_prompt("Use a quote from https://example.org/2020/09/30/a-b") == "chat"


def _result(tokens: int, steps: int) -> Result:
    return Result(request_id=0, token_ids=[1] * tokens, finish_reason="length", num_steps=steps, prompt_len=1)


def test_online_router_explores_then_routes_by_measured_tokens_per_s():
    router = WorkloadRouter(["mtp", "dfly"], online=True, explore=2)
    picks = [router.choose("code") for _ in range(4)]
    assert [c.reason for c in picks] == ["explore"] * 4
    assert sorted(c.drafter for c in picks) == ["dfly", "dfly", "mtp", "mtp"]
    assert picks[0].drafter == "dfly"  # the static rule's choice is tried first
    waiting = router.choose("code")  # explored, but nothing finished yet: the static rule decides
    assert (waiting.drafter, waiting.reason) == ("dfly", "prior")
    router.record("code", "dfly", _result(10, 10), seconds=2.0)  # 5 tok/s
    router.record("code", "mtp", _result(10, 4), seconds=1.0)  # 10 tok/s, MAL 3
    c = router.choose("code")
    assert (c.drafter, c.reason) == ("mtp", "measured")
    assert router.arm("code", "mtp").mean_accepted_length == pytest.approx(3.0)
    static = WorkloadRouter(["mtp", "dfly"])
    assert [static.choose(d).drafter for d in ("code", "math", "chat")] == ["dfly", "dfly", "mtp"]


def test_routed_generation_equals_ar_at_t0():
    target = tiny_target()
    drafters = {"dfly": DFlyDrafter(tiny_block_drafter(target, "dfly")), "mtp": NGramDrafter(max_ngram=2)}
    rng = random.Random(0)
    reqs = [Request([rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))], max_new_tokens=20, stop_ids=())
            for _ in range(9)]
    domains = ["code", "chat", "math"] * 3
    router = WorkloadRouter(list(drafters), online=True, explore=1)
    run = route_and_generate(target, drafters, reqs, router=router, domains=domains,
                             config=EngineConfig(max_batch_size=3, num_draft_tokens=3), wave_size=3)
    want = reference_generate(target, reqs)
    assert [r.token_ids for r in run.results] == [r.token_ids for r in want]
    assert run.waves == 3 and {c.drafter for c in run.choices} == {"dfly", "mtp"}
    assert run.overall.output_tokens == 9 * 20 and run.overall.requests == 9
    assert sum(s.requests for s in run.per_domain.values()) == 9
    single = route_and_generate(target, drafters, reqs, router=WorkloadRouter.fixed("dfly"),
                                config=EngineConfig(max_batch_size=3, num_draft_tokens=3))
    assert [r.token_ids for r in single.results] == [r.token_ids for r in want]
    assert list(single.per_drafter) == ["dfly"] and single.overall.mean_accepted_length >= 1.0


def test_bad_input_names_the_fix():
    with pytest.raises(RouterError, match="rule names drafters"):
        WorkloadRouter(["a", "b"])  # the default rule routes to "mtp" / "dfly"
    target = tiny_target()
    reqs = [Request([1, 2, 3], max_new_tokens=2)]
    with pytest.raises(RouterError, match="no drafter of that name"):
        route_and_generate(target, {"mtp": NGramDrafter()}, reqs, router=WorkloadRouter(["mtp", "dfly"]))
    with pytest.raises(RouterError, match="prompt_texts"):
        route_and_generate(target, {"mtp": NGramDrafter(), "dfly": NGramDrafter()}, reqs,
                           router=WorkloadRouter(["mtp", "dfly"]))
