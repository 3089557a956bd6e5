"""The linear layer of every model here, and the weight layout that makes verification cheap on a CPU.

`nn.Linear` stores W as [out, in] rows and computes x @ Wᵀ. For one row of x (an AR decode step) a CPU GEMM
reads W once and is bound by memory either way. For a few rows (verifying K + 1 drafted tokens, a block
drafter's B positions, a batch of requests) the fp32 GEMM kernels behind `F.linear` run far below what the same
multiply costs with W stored transposed, as a contiguous [in, out] matrix (`benchmarks/weight_layout.py`): on
the embedded target one verify forward over 8 tokens took 26% less time compiled, an AR step the same.

`Linear` is `nn.Linear` with that choice made by the weight's memory layout alone: a weight whose transpose is
contiguous (`transpose_weights`) is multiplied as x @ (Wᵀ), any other as `F.linear`. The values, the parameter's
shape [out, in], its name in `state_dict` and the checkpoint files are the same either way (`hf_io` saves
contiguous copies), so training, loading and exporting never see the difference. Only the inference engine
transposes, and only on CPU (`decoding.engine.SpecEngine`); GPU GEMMs do not care.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def is_transposed(weight: Tensor) -> bool:
    """True when `weight` [out, in] is stored as a contiguous [in, out] matrix (a view of its transpose)."""
    return weight.dim() == 2 and not weight.is_contiguous() and weight.t().is_contiguous()


class Linear(nn.Linear):
    """`nn.Linear` that multiplies by the stored transpose when its weight was laid out by `transpose_weights`."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if not is_transposed(w):
            return F.linear(x, w, self.bias)
        y = torch.matmul(x, w.t())
        return y if self.bias is None else y + self.bias


# A Linear whose weight is tied to an embedding (a tied LM head) gets its own transposed copy: the embedding must
# stay row-major, since gathering a token's row from a transposed table touches one cache line per element (on the
# embedded target that alone cost 0.1 ms per verify step). Above this size the copy's memory is not worth it and the
# head keeps F.linear.
TIED_COPY_MAX_BYTES = 64 * 2**20


@torch.no_grad()
def transpose_weights(module: nn.Module) -> int:
    """Store the weight of every `Linear` in `module` transposed ([in, out] contiguous, seen as the same
    [out, in] parameter), in place; returns how many weights it moved. Idempotent. A weight tied to a
    non-`Linear` module (an LM head tied to the embedding) is untied into a transposed copy when it is at most
    `TIED_COPY_MAX_BYTES`, else left alone. For frozen inference models (`decoding.engine` on CPU): the values
    do not change, but a tie that was split no longer ties training updates."""
    shared_elsewhere = {id(p) for m in module.modules() if not isinstance(m, Linear)
                        for p in m.parameters(recurse=False)}
    moved = 0
    for m in module.modules():
        if not isinstance(m, Linear):
            continue
        w = m.weight
        if w.dim() != 2 or is_transposed(w) or min(w.shape) == 1:
            continue
        if id(w) in shared_elsewhere:
            if w.numel() * w.element_size() > TIED_COPY_MAX_BYTES:
                continue
            m.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)
        else:
            w.data = w.data.t().contiguous().t()
        moved += 1
    return moved
