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

On a CPU the engine also prepacks the large weights (`prepack_weights`): such a `Linear` multiplies through a
native op (`few_rows`: C++, built at first use) that keeps copies of its weight laid out for few-row products, which
on CPUs whose BLAS runs few rows far below memory speed costs much less (`benchmarks/gemm_rows.py`): a row-major copy
for the few-rows kernel up to `few_rows.max_rows()` rows (one row included), and past that a copy reordered for
oneDNN. Where the native op cannot be built, an op written in Python here keeps the oneDNN copies for two rows or
more, and one row keeps the BLAS. The copies are looked up by a per-module key at each call and made again whenever
the weight is another tensor or was changed in place, so compiled graphs (which take the weight and the key as
inputs, never a copy) always multiply by the module's current weight.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from angelspec.models import few_rows


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
    """`nn.Linear` that multiplies by the stored transpose when its weight was laid out by `transpose_weights`, and
    through its prepacked copy (`prepack_weights`) for two rows or more where there is one and no gradient is
    being recorded."""

    def forward(self, x: Tensor) -> Tensor:
        key = self._buffers.get(PACK_KEY)
        if key is not None and x.is_cpu and not torch.is_grad_enabled():
            native = few_rows.native_op()  # (every row count: one row too goes faster through its kernel)
            if native is not None:
                return native(x, self.weight, self.bias, key)
            if x.numel() > x.shape[-1]:
                return _packed_linear_op(x, self.weight, self.bias, key)
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


# --- prepacked weights (CPU): the native op (`few_rows.native_op`), or oneDNN's copies through the op below ---
#
# A prepacked copy pays for itself only where the product is large enough that the packed call's set-up is small
# beside the GEMM: on the embedded target the fused QKV, gate-up, down projections and the LM head qualify, the
# 256 x 256 output projection does not (`benchmarks/gemm_rows.py`). Every weight of a real model does.
PACK_MIN_ELEMENTS = 2**17
PACK_ROWS = 8  # the row count oneDNN's layout is chosen for; the same copy serves any count from 2 up
PACK_KEY = "prepack_key"  # the non-persistent buffer a packed Linear carries (not in state_dict)


@dataclass
class _Pack:
    """One module's oneDNN copy and what it was made from (the Python op's; the native op keeps its own). `source` is
    held, so its memory cannot be reused by another tensor while a copy lives: the same data pointer, shape, strides
    and version counter then mean the same values (`_packed_linear` compares them inline: it runs for every packed
    layer of every forward)."""

    source: Tensor
    ptr: int
    version: int
    shape: torch.Size
    stride: tuple[int, ...]
    packed: Tensor | None = None  # oneDNN's reordered copy, made at the first product


_packs: dict[int, _Pack] = {}
_keys = itertools.count()
# (None in a torch built without oneDNN: the Python op then takes `linear`)
_linear_pointwise = (getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)
                     if torch.backends.mkldnn.is_available() else None)


def _packable(weight: Tensor) -> bool:
    """fp32 CPU weights that oneDNN can reorder and whose in-place changes the version counter records (an inference
    tensor has none)."""
    return weight.dtype == torch.float32 and weight.is_cpu and weight.dim() == 2 and not weight.is_inference()


def _packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None, key: Tensor) -> Tensor:
    """The prepacked product where the native op is not built: oneDNN's copy (`kernels/packed_op.cpp` does the same,
    with the few-rows kernel in front)."""
    pack = _packs.get(k := key.item())
    if (pack is None or weight.data_ptr() != pack.ptr or weight.is_inference() or weight._version != pack.version
            or weight.shape != pack.shape or weight.stride() != pack.stride):
        if not _packable(weight):  # swapped for a weight no copy can serve
            return linear(x, weight, bias)
        w = weight.detach()  # shares the version counter
        pack = _packs[k] = _Pack(w, w.data_ptr(), w._version, w.shape, w.stride())
    if x.dtype != torch.float32 or _linear_pointwise is None:  # (another dtype than the fp32 copy's: F.linear's error)
        return linear(x, weight, bias)
    if pack.packed is None:
        pack.packed = torch.ops.mkldnn._reorder_linear_weight(pack.source.contiguous(), PACK_ROWS)
    return _linear_pointwise(x, pack.packed, bias, "none", [], "")


def copies(module: nn.Module) -> set[str] | None:
    """Which copies a packed `Linear` holds now ({"rows", "onednn"} or a part; None: none made, or not packed)."""
    key = module._buffers.get(PACK_KEY)
    if key is None:
        return None
    if few_rows.native_op() is not None:
        return few_rows.copies(int(key))
    pack = _packs.get(int(key))
    return None if pack is None else ({"onednn"} if pack.packed is not None else set())


def _drop(key: int) -> None:
    _packs.pop(key, None)
    few_rows.drop(key)


_library = torch.library.Library("angelspec", "FRAGMENT")
_library.define("packed_linear(Tensor x, Tensor weight, Tensor? bias, Tensor key) -> Tensor")
_library.impl("packed_linear", _packed_linear, "CPU")


_packed_linear_op = torch.ops.angelspec.packed_linear.default


@torch.library.register_fake("angelspec::packed_linear")
def _packed_linear_shape(x: Tensor, weight: Tensor, bias: Tensor | None, key: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def prepack_available() -> bool:
    """Whether prepacked copies can serve here: the native op built (`few_rows.available`; built by this call at its
    first use), or this torch has oneDNN's prepacked product."""
    return few_rows.available() or few_rows.native_op() is not None or _linear_pointwise is not None


@torch.no_grad()
def prepack_weights(module: nn.Module, enabled: bool = True) -> int:
    """Give every `Linear` in `module` with an fp32 CPU weight of at least `PACK_MIN_ELEMENTS` elements prepacked
    copies (`enabled`), or take the copies away (not `enabled`); returns how many `Linear`s have one
    afterwards. Idempotent, but existing copies are dropped and made again at the next call, so every engine starts
    from the weights as they are (even where they were written through `.data`, which no version counter records).
    Inference only: a `Linear` uses its copies only while no gradient is recorded. Each copy costs the weight's
    memory once more: the row-major one is made at the first product up to `few_rows.max_rows()` rows, the oneDNN
    one at the first of more rows."""
    packed = 0
    for m in module.modules():
        if not isinstance(m, Linear):
            continue
        key = m._buffers.get(PACK_KEY)
        want = (enabled and prepack_available() and _packable(m.weight)
                and m.weight.numel() >= PACK_MIN_ELEMENTS)
        if key is not None:
            # a kept key's copy is made again at the next call, from the weight as it is now: values written
            # through `.data` (which the version counter does not see) count from here on
            _drop(int(key))
            if not want:
                del m._buffers[PACK_KEY]
        elif want:
            k = next(_keys)
            m.register_buffer(PACK_KEY, torch.tensor(k), persistent=False)
            weakref.finalize(m, _drop, k)
        packed += want
    return packed


def lay_out_weights(module: nn.Module, prepack: bool = True) -> None:
    """What the engine does to a model it runs on a CPU: `transpose_weights`, then `prepack_weights(module,
    prepack)`."""
    transpose_weights(module)
    prepack_weights(module, prepack)
