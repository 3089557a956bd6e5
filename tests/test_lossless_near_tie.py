"""The T=0 lossless check's near-tie rule (`eval.lossless`, `eval.speculative.compare`): a departure from AR counts
as exact only where the target's best logits nearly tie at that position; every other departure still fails."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_decoder

from angelspec.decoding.metrics import DecodeMetrics
from angelspec.eval import speculative
from angelspec.eval.lossless import check_divergence, near_tie_rtol

PROMPT = [3, 9, 17, 30]


def test_default_tolerance_follows_the_targets_dtype():
    assert near_tie_rtol(torch.float32) == near_tie_rtol(torch.float64) == 1e-3
    assert near_tie_rtol(torch.bfloat16) == 2 ** -5  # 4 bf16 epsilons (8 significant bits)
    assert near_tie_rtol(torch.float16) == 2 ** -8


def _tied_target(scale: float = 1.0):
    """A target whose LM-head row of token b is row a times `scale`, a being its greedy choice after PROMPT: at that
    position a and b tie exactly (scale 1) or nearly; `worst` is the token with the lowest logit there."""
    target = tiny_decoder(vocab=64, layers=2, dtype=torch.float32)
    with torch.no_grad():
        logits = target(torch.tensor([PROMPT])).logits[0, -1]
        a = int(logits.argmax())
        b = (a + 1) % 64
        target.lm_head.weight[b] = target.lm_head.weight[a] * scale  # tied: the embedding row moves too
        worst = int(target(torch.tensor([PROMPT])).logits[0, -1].argmin())
    return target, a, b, worst


def _report(target, ar_out, spec_out, rtol=None):
    settings = speculative.EvalSettings(max_new_tokens=4, num_draft_tokens=2)
    prompts = [speculative.EvalPrompt(PROMPT, "code", 1), speculative.EvalPrompt(PROMPT, "code", 2)]
    metrics = {"code": DecodeMetrics(num_draft_tokens=2, output_tokens=8, wall_s=1.0)}
    ar = speculative.DecodeRun(settings, 2, metrics, ar_out)
    spec = speculative.DecodeRun(settings, 2, metrics, spec_out)
    return speculative.compare(ar, spec, prompts, name="x", target=target, near_tie_rtol=rtol)


def test_a_departure_at_an_exact_tie_is_a_counted_near_tie_not_a_failure():
    target, a, b, _ = _tied_target()
    report = _report(target, [[a, 5], [a, 6]], [[b, 7], [a, 6]])
    (m,) = report.mismatches
    assert m.near_tie and m.tie.ar_gap == m.tie.spec_gap == 0.0 and m.tie.tolerance >= 1e-3
    assert report.lossless is True and report.near_ties == [m] and report.failures == []
    assert report.overall.identical == 1  # outputs equal token for token: one; the near-tie is reported, not hidden
    assert "lossless: yes (1/2 identical to AR, 1 near-tie" in report.format()
    assert "a near-tie" in report.format()
    block = report.to_dict()["lossless"]
    assert block["ok"] is True and block["near_ties"] == 1 and block["mismatches"][0]["near_tie"] is True


def test_any_other_departure_still_fails_loudly():
    target, a, _, worst = _tied_target()
    report = _report(target, [[a, 5], [a, 6]], [[worst, 7], [a, 6]])
    (m,) = report.mismatches
    assert not m.near_tie and m.tie.spec_gap > m.tie.tolerance
    assert report.lossless is False and report.failures == [m]
    line = report.lossless_line()
    assert line.startswith("lossless: NO: 1/2 outputs differ") and "This is a bug" in line
    assert "not a near-tie" in report.format()


def test_an_output_that_ends_on_one_side_only_is_never_a_near_tie():
    target, a, b, _ = _tied_target()
    report = _report(target, [[a], [a, 6]], [[a, b], [a, 6]])  # AR stopped, the speculative run went on
    assert report.mismatches[0].tie is None and report.lossless is False


def test_the_tolerance_decides_a_close_but_unequal_pair():
    target, a, b, _ = _tied_target(scale=1 - 1e-5)  # b's logit a hair below a's
    tie = check_divergence(target, PROMPT, a, b, rtol=1e-3)
    assert tie is not None and 0 < tie.spec_gap <= tie.tolerance and tie.near_tie
    assert not check_divergence(target, PROMPT, a, b, rtol=1e-9).near_tie
    assert _report(target, [[a, 5], [a, 6]], [[b, 7], [a, 6]], rtol=1e-9).lossless is False
    assert _report(target, [[a, 5], [a, 6]], [[b, 7], [a, 6]]).lossless is True  # the fp32 default, 1e-3


def test_the_divergence_is_checked_after_the_shared_completion():
    """The logits are the target's after prompt + the tokens both outputs share, not after the prompt alone."""
    target, a, b, _ = _tied_target()
    with torch.no_grad():
        after = target(torch.tensor([[*PROMPT, a, a]])).logits[0, -1]
    best, worst = int(after.argmax()), int(after.argmin())
    report = _report(target, [[a, a, best], [a, 6]], [[a, a, worst], [a, 6]])
    (m,) = report.mismatches
    assert m.position == 2 and m.tie.best == pytest.approx(float(after.max()), abs=1e-5) and not m.near_tie


def test_evaluate_passes_the_target_so_the_cli_check_uses_the_rule():
    """`evaluate` (what `angelspec eval` and the demo run) checks its mismatches against the target: an exactly
    lossless run reports the tolerance it would have used and no near-ties."""
    from angelspec.decoding.drafters.ngram import NGramDrafter

    target = tiny_decoder(vocab=64, layers=2, dtype=torch.float32)
    prompts = [speculative.EvalPrompt([5, 6, 7, 5, 6], "code")]
    settings = speculative.EvalSettings(max_new_tokens=6, batch_size=1, num_draft_tokens=2, warmup_tokens=0)
    report = speculative.evaluate(target, NGramDrafter(), prompts, settings, name="ngram", progress=False)
    assert report.lossless is True and report.near_tie_rtol == 1e-3 and report.near_ties == []


def test_the_serving_benchmark_counts_near_ties_and_fails_the_rest():
    """`angelspec bench`'s lossless column: outputs that part from the AR configuration's at a near-tie are counted
    beside the identical ones; any other difference is still NO."""
    from dataclasses import replace

    from angelspec.eval.serving.base import ServingRow
    from angelspec.eval.serving.sweep import _near_ties

    target, a, b, worst = _tied_target()
    workload = [speculative.EvalPrompt(PROMPT, "code")]
    ar = [[a, 5], [a, 6], [a, 7]]  # three requests of the one-prompt workload
    assert _near_ties(target, workload, 3, ar, [[b, 1], [a, 6], [worst, 7]]) == 1
    row = ServingRow(config="x", drafter="ngram", kind="ngram", policy="full", num_draft_tokens=2, concurrency=1,
                     requests=3, output_tokens=6, wall_s=1.0, tokens_per_s=6.0, per_user_tokens_per_s=6.0, mal=1.0,
                     mean_depth=1.0, steps=3, exec_s_per_step=0.0, sample_s_per_step=0.0)
    assert replace(row, identical=2, near_ties=1).lossless_ok is True
    assert replace(row, identical=1, near_ties=1).lossless_ok is False
    assert row.lossless_ok is None
