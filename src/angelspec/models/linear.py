"""The linear layer of every model here, and the weight layout that makes verification cheap on a CPU.

`nn.Linear` stores W as [out, in] rows and computes x @ Wᵀ. For one row of x (an AR decode step) a CPU GEMM
reads W once and is bound by memory either way. For a few rows (verifying K + 1 drafted tokens, a block
drafter's B positions, a batch of requests) the fp32 GEMM kernels behind `F.linear` run far below what the same
multiply costs with W stored transposed, as a contiguous [in, out] matrix (`benchmarks/weight_layout.py`;
numbers: docs/design.md §10 and §12).

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
    """True when `weight` [out, in] is stored column by column: a view of a row-major [in, out'] matrix (out' >=
    out, so row slices of a transposed weight count), which a GEMM reads as its transpose without a copy."""
    return (weight.dim() == 2 and weight.shape[0] > 1 and weight.shape[1] > 1 and weight.stride(0) == 1
            and weight.stride(1) >= weight.shape[0])


def transposed_copy(weight: Tensor) -> Tensor:
    """The same [out, in] values, stored transposed (`is_transposed`)."""
    return weight.t().contiguous().t()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`, as x @ Wᵀ straight from the stored transpose when `weight` is laid out that way
    (the fast few-row GEMM on CPU), else `F.linear` itself."""
    if not is_transposed(weight):
        return F.linear(x, weight, bias)
    y = torch.matmul(x, weight.t())
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """`nn.Linear` that multiplies by the stored transpose when its weight was laid out by `transpose_weights`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


# A Linear whose weight is tied to an embedding (a tied LM head) gets its own transposed copy: the embedding must
# stay row-major, since gathering a token's row from a transposed table touches one cache line per element
# (docs/design.md §12). Above this size the copy's memory is not worth it and the
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
            m.weight = nn.Parameter(transposed_copy(w.detach()), requires_grad=w.requires_grad)
        else:
            w.data = transposed_copy(w.data)
        moved += 1
    return moved
