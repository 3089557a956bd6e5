"""Predicted vs measured committed tokens of a confidence-driven depth policy (AngelSpec §4.2, Eq. 19–21).

D-cut (and Algorithm 1) rank (request, depth) pairs by prefix survival s_{i,k} = Π_{t≤k} c_{i,t} and keep, per
row, a prefix of n_i drafts; the step's expected committed tokens for row i are then

    A_i(n_i) = Σ_{k=0}^{n_i} s_{i,k}          (s_{i,0} = 1: the bonus / recovered token always commits)

and D-cut's utility U(B, ρ) is their sum over the batch. If the confidences are what they claim (the acceptance
of each draft given an accepted prefix, under the protocol the engine runs), the mean of A_i(n_i) over row-steps
equals the mean of the tokens verification actually committed (accepted + 1). `CommitPredictionRecorder`, a
`SpecEngine(on_verify=...)` observer, keeps both per active row and step, from the confidences the policy saw (the
proposal's, sanitised as the policies sanitise them; a `CalibratedDrafter`'s are already calibrated) and the depth
it chose; `predicted_vs_measured` decodes prompts at one sampling temperature and returns the two means
(`benchmarks/confidence_protocol.py` prints them per temperature and drafter).

Shape legend: B batch rows, K drafts per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import Drafter
from angelspec.decoding.engine import DepthPolicyFn, EngineConfig, Request, SpecEngine, VerifyEvent
from angelspec.decoding.policies.base import sanitize_confidences
from angelspec.decoding.policies.budget import prefix_survival
from angelspec.decoding.sampling import SamplingParams
from angelspec.models.decoder import Decoder


def predicted_commits(confidences: Tensor, depth: Tensor) -> Tensor:
    """A_i(n_i) = Σ_{k=0}^{n_i} Π_{t≤k} c_{i,t}: confidences [B, K] (sanitised here as the policies do), depth [B]
    (drafts each row verified) -> [B] float64."""
    clean, _ = sanitize_confidences(confidences)
    s = prefix_survival(clean.double())  # [B, K+1]
    k = torch.arange(s.shape[1], device=s.device)
    return (s * (k[None, :] <= depth[:, None])).sum(dim=-1)


@dataclass(frozen=True)
class CommitPrediction:
    """Means over every active (row, step) of one run: `predicted` A_i(n_i), `measured` accepted + 1, `depth` n_i."""

    row_steps: int
    predicted: float
    measured: float
    depth: float

    @property
    def ratio(self) -> float:
        """predicted / measured: 1 for confidences that are right on average, > 1 for over-confident ones."""
        return self.predicted / self.measured if self.measured else float("nan")


class CommitPredictionRecorder:
    """`SpecEngine(on_verify=...)` observer: per active row and step, the committed tokens the proposal's confidences
    predict at the depth the policy chose (`predicted_commits`) and the tokens verification committed."""

    def __init__(self) -> None:
        self._predicted: list[Tensor] = []
        self._measured: list[Tensor] = []
        self._depth: list[Tensor] = []

    def __call__(self, event: VerifyEvent) -> None:
        conf = event.proposal.confidences
        if conf is None:
            raise ValueError("the drafter reports no confidences, so there is no prediction to check")
        active = event.active
        self._predicted.append(predicted_commits(conf, event.depth)[active].cpu())
        self._measured.append((event.num_accepted[active] + 1).double().cpu())
        self._depth.append(event.depth[active].double().cpu())

    def summary(self) -> CommitPrediction:
        """The means over every recorded row-step (an empty run: zeros)."""
        if not self._predicted:
            return CommitPrediction(0, 0.0, 0.0, 0.0)
        predicted, measured, depth = (torch.cat(x) for x in (self._predicted, self._measured, self._depth))
        n = predicted.numel()
        if n == 0:
            return CommitPrediction(0, 0.0, 0.0, 0.0)
        return CommitPrediction(n, float(predicted.mean()), float(measured.mean()), float(depth.mean()))


def predicted_vs_measured(target: Decoder, drafter: Drafter, prompt_ids: Sequence[Sequence[int]], *,
                          depth_policy: DepthPolicyFn, temperature: float, num_draft_tokens: int, batch_size: int,
                          max_new_tokens: int, seed: int = 0) -> CommitPrediction:
    """Decode `prompt_ids` at sampling `temperature` (request i with seed `seed` + i) with `drafter` under
    `depth_policy` and return the mean predicted and measured committed tokens per row-step."""
    recorder = CommitPredictionRecorder()
    context = target.config.max_position_embeddings
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=batch_size, num_draft_tokens=num_draft_tokens),
                        depth_policy=depth_policy, on_verify=recorder)
    sampling = [SamplingParams() if temperature == 0 else SamplingParams(temperature=temperature, seed=seed + i)
                for i in range(len(prompt_ids))]
    engine.generate([Request(prompt_ids=list(ids), max_new_tokens=max(1, min(max_new_tokens, context - len(ids))),
                             sampling=sampling[i]) for i, ids in enumerate(prompt_ids)])
    return recorder.summary()
