"""Calibration (spec/calibration.py): ECE on hand-computed cases, Sequential Temperature Scaling on
synthetic miscalibrated confidences with known temperatures, JSON round trip next to a checkpoint, and the
policy wrapper that feeds calibrated confidences to a budget."""

from __future__ import annotations

import json
import math

import pytest
import torch

from angelspec.decoding.drafters.base import Proposal
from angelspec.decoding.policies.base import FixedDepth
from angelspec.decoding.policies.dcut import DCut
from angelspec.decoding.policies.sts import (
    CALIBRATION_FILE,
    CalibratedPolicy,
    StsCalibration,
    apply_temperatures,
    apply_temperatures_to_confidences,
    cumulative_ece,
    ece,
    fit_sts,
    temperature_grid,
)


def test_ece_by_hand():
    conf = torch.tensor([0.05, 0.15, 0.95, 0.95])
    labels = torch.tensor([0.0, 1.0, 1.0, 0.0])
    # 10 bins: {0.05} |0 - .05|, {0.15} |1 - .15|, {.95, .95} |0.5 - .95| * 2  ->  (.05 + .85 + .9) / 4
    assert float(ece(conf, labels, 10)) == pytest.approx((0.05 + 0.85 + 0.9) / 4)
    assert float(ece(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), 15)) == 0.0  # 1.0 -> last bin
    batched = ece(torch.stack([conf, 1 - conf]), labels, 10)  # [2]: leading dims are separate problems
    assert batched.shape == (2,) and float(batched[0]) == pytest.approx(float(ece(conf, labels, 10)))


def _synthetic(n: int, true_t: list[float], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """True acceptance probabilities p [N, K]; the reported confidence is p^{T_k}, so c^{1/T_k} = p recovers
    them exactly and STS should find T_k. Outcomes are independent Bernoulli(p) per position."""
    g = torch.Generator().manual_seed(seed)
    p = 0.05 + 0.93 * torch.rand(n, len(true_t), generator=g, dtype=torch.float64)  # [N, K]
    accepted = torch.rand(n, len(true_t), generator=g, dtype=torch.float64) < p
    c = p ** torch.tensor(true_t, dtype=torch.float64)
    return torch.log(c) - torch.log1p(-c), accepted  # logits, outcomes


def test_sts_finds_known_temperatures_and_lowers_ece():
    true_t = [0.5, 2.0, 1.0, 3.0]
    logits, accepted = _synthetic(20000, true_t)
    cal = fit_sts(logits, accepted)
    for got, want in zip(cal.temperatures, true_t, strict=True):
        assert abs(math.log(got / want)) < 0.15, (cal.temperatures, true_t)
    assert all(a < 0.5 * b for a, b in zip(cal.ece_after, cal.ece_before, strict=True) if b > 0.02)
    assert max(cal.ece_after) < 0.02
    # Held-out blocks from the same source: the fitted temperatures still help.
    logits2, accepted2 = _synthetic(20000, true_t, seed=1)
    raw = cumulative_ece(torch.sigmoid(logits2), accepted2)
    fixed = cumulative_ece(cal.apply(logits2), accepted2)
    assert sum(fixed) < 0.3 * sum(raw)


def test_grid_search_recovers_a_single_temperature():
    logits, accepted = _synthetic(30000, [2.5])
    cal = fit_sts(logits, accepted, grid=temperature_grid(200))
    assert cal.temperatures[0] == pytest.approx(2.5, rel=0.1)


def test_apply_temperatures():
    z = torch.tensor([[-200.0, 0.0, 3.0]])
    out = apply_temperatures(z, [2.0, 0.5, 1.0])
    assert torch.allclose(out, torch.tensor([[math.exp(-100.0), 0.25, float(torch.sigmoid(torch.tensor(3.0)))]]))
    c = torch.tensor([[0.25, 0.81]])
    assert torch.allclose(apply_temperatures_to_confidences(c, [2.0, 2.0]), torch.tensor([[0.5, 0.9]]))
    with pytest.raises(ValueError, match="one temperature per position"):
        apply_temperatures(z, [1.0])
    with pytest.raises(ValueError, match="> 0"):
        apply_temperatures(z, [1.0, 0.0, 1.0])


def test_save_load_next_to_checkpoint(tmp_path):
    assert StsCalibration.load(tmp_path) is None
    cal = StsCalibration(temperatures=(0.5, 2.0), ece_before=(0.2, 0.3), ece_after=(0.01, 0.02))
    path = cal.save(tmp_path)
    assert path == tmp_path / CALIBRATION_FILE and json.loads(path.read_text())["method"] == "sts"
    assert StsCalibration.load(tmp_path) == cal
    path.write_text(json.dumps({"method": "sts", "temperatures": [1.0, -1.0]}))
    with pytest.raises(ValueError, match="finite and > 0"):
        StsCalibration.load(tmp_path)
    path.write_text(json.dumps({"method": "platt", "temperatures": [1.0]}))
    with pytest.raises(ValueError, match="unknown calibration method"):
        StsCalibration.load(tmp_path)


def test_fit_drops_non_finite_rows_and_checks_shapes():
    logits, accepted = _synthetic(2000, [1.0, 1.0])
    logits[0, 1] = float("nan")
    cal = fit_sts(logits, accepted)
    assert all(math.isfinite(t) for t in cal.temperatures)
    with pytest.raises(ValueError, match="one shape"):
        fit_sts(logits, accepted[:, :1])


def test_calibrated_policy_passes_calibrated_confidences():
    seen = []

    def spy(proposal, state):
        seen.append(proposal.confidences)
        return torch.zeros(proposal.tokens.shape[0], dtype=torch.int64)

    cal = StsCalibration(temperatures=(2.0,))
    wrapped = CalibratedPolicy(spy, cal)
    tokens = torch.zeros(1, 3, dtype=torch.int64)
    wrapped(Proposal(tokens=tokens, confidences=torch.tensor([[0.25, 0.81, 0.04]])), None)
    assert torch.allclose(seen[0], torch.tensor([[0.5, 0.9, 0.2]]))  # the last temperature is reused
    assert wrapped.uses_proposal is True and CalibratedPolicy(FixedDepth(2), cal).static_depth == 2
    assert CalibratedPolicy(FixedDepth(2), cal).uses_proposal is False and CalibratedPolicy(DCut(), cal).uses_proposal
    with pytest.raises(AttributeError):  # the wrapped policy's declaration, read-only like the policies' own (trap 1)
        wrapped.uses_proposal = False


def test_calibrated_drafter_compiles_its_inner_drafter_once():
    """EngineConfig(compile=True) calls `ensure_compiled` on the engine's drafter: a calibrated wrapper must pass
    it to the drafter it wraps (whose hot calls are the ones worth compiling), once however many engines share
    it."""
    from angelspec.decoding.drafters.calibrated import CalibratedDrafter
    from angelspec.decoding.drafters.ngram import NGramDrafter

    class Counting(NGramDrafter):
        calls = 0

        def compile(self) -> None:
            type(self).calls += 1

    inner = Counting()
    wrapped = CalibratedDrafter(inner, StsCalibration(temperatures=(1.0,)))
    for d in (wrapped, wrapped, inner):
        d.ensure_compiled()
    assert Counting.calls == 1
