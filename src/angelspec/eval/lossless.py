"""The T=0 lossless check's near-tie rule: when a speculative output departs from the AR output of the same prompt,
was the target itself undecided there?

Speculative decoding verifies K+1 positions in one forward ([B, K+1] rows) where AR decoding runs one ([B, 1]). On a
GPU the two shapes take different kernels and reduction orders (cuBLAS, split-K, TF32 or bf16 accumulation), so the
logits of one position differ in their last bits between the two runs. Where the target's two best tokens are that
close, greedy decoding may pick either, and the outputs part there without any error in the drafter or the verifier;
everywhere else the argmax is stable and a difference is a bug.

The rule: at the first differing position, the target is run once more on the common prefix (prompt + the shared
completion tokens) and the divergence counts as a near-tie only when both tokens, AR's and the speculative one, have
logits within `tolerance` of the best logit there, where

    tolerance = rtol * max(1, |best logit|),  rtol = max(1e-3, 4 * eps(dtype of the target))

(`near_tie_rtol`: 1e-3 for fp32 and fp64 targets, leaving room for TF32 matmuls; 2^-5 = 0.031 for bf16, whose logits
carry 8 significant bits; 2^-8 = 0.0039 for fp16). A departure where one output ended (a stop token or the budget on
one side only) or where a token is not among the near-tied best is never a near-tie: it fails the check loudly, as
before. Near-ties are reported and counted; the outputs agree token for token up to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from angelspec.models.decoder import Decoder, TrainInputs

NEAR_TIE_RTOL_FLOOR = 1e-3  # fp32 / fp64 targets (covers TF32 matmuls on a GPU)
NEAR_TIE_EPS = 4  # machine epsilons of the target's dtype, when larger than the floor


def near_tie_rtol(dtype: torch.dtype) -> float:
    """The default relative tolerance for a target whose weights are `dtype` (module docstring)."""
    return max(NEAR_TIE_RTOL_FLOOR, NEAR_TIE_EPS * torch.finfo(dtype).eps)


@dataclass(frozen=True)
class TieCheck:
    """The target's logits at a divergence: how far AR's and the speculative token are below the best logit, and the
    tolerance they were held to (absolute, in logit units)."""

    best: float  # the best logit at the position
    ar_gap: float  # best - logit(AR's token)
    spec_gap: float  # best - logit(speculative token)
    tolerance: float

    @property
    def near_tie(self) -> bool:
        return max(self.ar_gap, self.spec_gap) <= self.tolerance

    def describe(self) -> str:
        gap = max(self.ar_gap, self.spec_gap)
        verdict = "a near-tie" if self.near_tie else "not a near-tie"
        return (f"{verdict}: the tokens lie {gap:.3g} below the target's best logit {self.best:.3g} "
                f"(tolerance {self.tolerance:.3g})")


@torch.no_grad()
def check_divergence(target: Decoder, prefix: Sequence[int], ar_token: int | None, spec_token: int | None,
                     rtol: float | None = None) -> TieCheck | None:
    """The target's logits after `prefix` (prompt + common completion) compared at AR's and the speculative token;
    None when either side has no token there (its output ended): that is never a near-tie."""
    if ar_token is None or spec_token is None or not prefix:
        return None
    weight = target.embed_tokens.weight
    rtol = near_tie_rtol(weight.dtype) if rtol is None else rtol
    ids = torch.tensor([list(prefix)], dtype=torch.long, device=weight.device)
    last = torch.tensor([[len(prefix) - 1]], dtype=torch.long, device=weight.device)
    logits = target(ids, TrainInputs(logits_index=last)).logits
    assert logits is not None
    row = logits[0, -1].float()
    best = float(row.max())
    return TieCheck(best=best, ar_gap=best - float(row[ar_token]), spec_gap=best - float(row[spec_token]),
                    tolerance=rtol * max(1.0, abs(best)))
