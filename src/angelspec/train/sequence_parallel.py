"""Ulysses sequence parallelism for drafter training (AngelSpec report §6.1): `angelspec train ... --sp N`.

An SP group of N ranks trains on the same packed rows; rank s of the group owns the contiguous tokens
[s·T/N, (s+1)·T/N) of every row (its *shard*). Everything a drafter does per token (the fusion of taps and token
embeddings, the q/k/v and output projections, the MLP, the LM head and the loss) runs on the shard only. Attention
is the one place where a token needs the others; there the Ulysses exchange switches the sharding:

    q, k, v  [B, H, T/N, Dh] (all heads, my tokens)  --all-to-all-->  [B, H/N, T, Dh] (my heads, every token)
    attention over the whole row (the tiled document-masked kernels of `models.attention`, unchanged)
    out      [B, H/N, T, Dh]                          --all-to-all-->  [B, H, T/N, Dh]

(`SequenceParallel.to_heads` / `.to_sequence`, autograd functions whose backward is the inverse exchange). Heads
must divide by N; when the kv heads do not (GQA with fewer kv heads than N), each kv head is repeated for the
query heads that read it before the exchange (more bytes moved, same result), so only the query heads must divide.

The halo. Supervision looks ahead: MTP depth k at position i is trained on x_{i+k+2} with the teacher's
distribution at i+k+1, and its depth-0 input is x_{i+1}; a block anchored at a predicts x_{a+1..a+B−1} with the
teacher at a..a+B−2. So rank s also reads the h tokens after its shard, h = D + 1 for D TTT depths and B − 1
for block size B (`window`): their ids, document ids and loss mask (the depth-shift and document gates of
`data.packing` then run on the window exactly as on the whole row: a label across a document end, or across
the row end on the last rank, stays invalid, whichever rank the document started on), and the teacher logits of
those positions. No drafter state is computed for the halo: it is supervision, not work. The TTT diagonal (depth
j's key at the same position i) and the causal prefix are reached through the all-to-all, so they need no halo.

The frozen target is sequence-parallel too (`target_forward`, through `train.features.TargetFeatures`): each rank
embeds only its shard's tokens and runs them through the target's layers with their document-local positions; the
target's attention is the same Ulysses exchange around the tiled document-masked kernel (`target_attention`, under
no_grad), so no rank holds a whole row's activations, a [T, T] mask or the whole row's teacher logits. The taps the
drafter reads are the shard's (no drafter state is computed for the halo). The halo's teacher logits come from the
next rank: it sends the final-norm states of its first h positions (the hidden size a position, not V logits) by
one point-to-point exchange (`SequenceParallel.halo_from_next`: every rank but the first sends to its predecessor,
every rank but the last receives; the last rank's halo is empty, the row ends there), and each rank runs the LM
head on shard + halo. A shard must be at least h long (`check_halo`): the halo comes from the next rank alone. From an
offline cache (`features=DIR`) no target runs: each rank reads its rows, keeps the shard's taps and takes the halo
the same way. Every rank still holds the whole rows' token ids, positions, document ids and loss mask (the data
loader's, about 33 bytes a token): the depth-shift and document gates read the halo's ids, and the attention's
tile masks and the block anchors' index read the whole row's document ids.

Block anchors are drawn per whole row, as without SP (`train.block.row_anchors`), and each valid anchor belongs to
the rank whose shard holds it (`shard_anchors`); every rank pads its anchors to the same count M (the most any
rank holds in any row; invalid anchors are dropped, they never reach the loss) so the exchange moves equal
pieces. After the exchange the queries of all ranks' anchors line up rank after rank, and the attention index
(`models.block.drafter.AnchorIndex`) is built over that layout and the whole row's document ids.

Losses. Each rank's loss is its tokens' share: per-token sums over its shard, divided by denominators summed over
every rank (`train.losses.global_denominators` with the world all-reduce, as data parallelism already does), so
the shares of all ranks add up to the single-process loss. The gradient of a rank's share reaches the other ranks'
activations through the exchange's backward; DDP / FSDP2 over all ranks (data-parallel x sequence-parallel) then
sum what each rank's replica received (`train.distributed`: the trainer backpropagates world_size x its share). So
SP composes with DDP and FSDP2 unchanged: they shard or replicate the drafter over all ranks, the SP group only
decides which tokens a rank sees. Data parallelism runs across SP groups: ranks [g·N, (g+1)·N) form group g, which
takes slice g of the global batch (`dp`).

The SP exchange runs on a process group of its own (`torch.distributed.new_subgroups`), so its collectives never
interleave with DDP's gradient all-reduces or FSDP2's gathers on the default group. gloo (CPU) and NCCL (GPU) both
implement `all_to_all_single`, which the exchange uses.

Shape legend: B rows, T row length, S = T/N shard length, N SP ranks, H (kv) heads, Dh head dim, M anchors per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from angelspec.data.packing import PackedBatch
from angelspec.errors import UsageError
from angelspec.models.attention import document_first_index, document_prefix_attention
from angelspec.models.block.drafter import AnchorIndex, anchored_block_attention
from angelspec.models.decoder import Attend, Decoder, DecoderOutput, TrainInputs
from angelspec.train.distributed import DistInfo


def _exchange(x: Tensor, group: Any) -> Tensor:
    """all_to_all_single over dim 0 ([N, ...]: chunk j goes to rank j, chunk i of the result came from rank i)."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous too (empty_like keeps a view's strides, the collective writes densely)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: Tensor, n: int, group: Any) -> Tensor:
    """[B, H, S, Dh] (my tokens, all heads) -> [B, H/n, n·S, Dh] (my head group, every rank's tokens in order)."""
    B, H, S, Dh = x.shape
    sent = x.reshape(B, n, H // n, S, Dh).transpose(0, 1)  # [n, B, H/n, S, Dh]: head group j to rank j
    got = _exchange(sent, group)  # [n, B, H/n, S, Dh]: rank i's tokens of my head group
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * S, Dh)


def _heads_to_seq(y: Tensor, n: int, group: Any) -> Tensor:
    """The inverse of `_seq_to_heads`: [B, H/n, n·S, Dh] -> [B, H, S, Dh]."""
    B, Hn, T, Dh = y.shape
    sent = y.reshape(B, Hn, n, T // n, Dh).permute(2, 0, 1, 3, 4)  # [n, B, H/n, S, Dh]: token block j to rank j
    got = _exchange(sent, group)  # [n, B, H/n, S, Dh]: head group i of my tokens, from rank i
    return got.transpose(0, 1).reshape(B, n * Hn, T // n, Dh)


class _Exchange(torch.autograd.Function):
    """One Ulysses exchange: sequence-sharded -> head-sharded (`heads` True) or back; the backward sends the gradient
    the inverse way (an all-to-all is a permutation of the pieces over the ranks, so its adjoint is its inverse)."""

    @staticmethod
    def forward(ctx, x: Tensor, n: int, group: Any, heads: bool) -> Tensor:
        ctx.n, ctx.group, ctx.heads = n, group, heads
        return (_seq_to_heads if heads else _heads_to_seq)(x, n, group)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None, None]:
        return (_heads_to_seq if ctx.heads else _seq_to_heads)(g, ctx.n, ctx.group), None, None, None


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its SP group (size 1: no sequence parallelism, every method the identity / whole row)
    and the data-parallel view across groups (`dp`: rank = the group's index, world_size = the number of groups)."""

    size: int = 1
    rank: int = 0  # within the SP group
    group: Any = None  # the SP group's ProcessGroup (None for size 1)
    dp: DistInfo = DistInfo()

    @property
    def enabled(self) -> bool:
        return self.size > 1

    # ----- which tokens this rank owns -----
    def bounds(self, T: int) -> tuple[int, int]:
        """[start, stop) of this rank's shard of a row of T tokens."""
        if T % self.size:
            raise UsageError(f"seq_len={T} does not divide over --sp {self.size} ranks; pick a seq_len that is a "
                             f"multiple of {self.size}")
        S = T // self.size
        return self.rank * S, (self.rank + 1) * S

    def columns(self, T: int, halo: int = 0) -> slice:
        """The shard's positions plus the `halo` after it (cut at the row end)."""
        start, stop = self.bounds(T)
        return slice(start, min(stop + halo, T))

    def shard(self, t: Tensor, dim: int = 1) -> Tensor:
        """This rank's shard of `t` along `dim` (the row's time axis), as its own tensor."""
        start, stop = self.bounds(t.shape[dim])
        return t.narrow(dim, start, stop - start).contiguous()

    def window(self, batch: PackedBatch, halo: int) -> PackedBatch:
        """The columns of `batch` that this rank's supervision reads: its shard plus `halo` tokens after it (the
        [B, T] tensors cut; counts such as `num_tokens` and `row_docs` stay the whole rows')."""
        cols = self.columns(batch.seq_len, halo)
        parts = {f.name: getattr(batch, f.name) for f in fields(batch)}
        return PackedBatch(**{k: v[:, cols] if isinstance(v, Tensor) and v.dim() == 2 else v
                              for k, v in parts.items()})

    def shard_tokens(self, batch: PackedBatch) -> int:
        """Real (non-padding) tokens in this rank's shard of `batch` (per-rank counts add up to the batch's)."""
        return int((self.shard(batch.document_ids) >= 0).sum()) if self.enabled else batch.num_tokens

    # ----- the Ulysses exchange -----
    def check_heads(self, heads: int, whose: str = "drafter") -> None:
        """Refuse a drafter (or target: `whose`) whose attention heads do not divide over the SP ranks."""
        if heads % self.size:
            fix = "num_attention_heads=<a multiple of the SP size>" if whose == "drafter" else "another target"
            raise UsageError(f"the {whose}'s {heads} attention heads do not divide over --sp {self.size} ranks "
                             f"(Ulysses gives each rank heads/N heads); pick --sp dividing the head count or {fix}")

    def check_halo(self, T: int, halo: int, what: str) -> None:
        """Refuse shards shorter than the halo (`what` names where it comes from): a rank's halo must come from
        the next rank's shard alone (`halo_from_next`)."""
        S = self.bounds(T)[1] - self.bounds(T)[0]
        if self.enabled and halo > S:
            raise UsageError(f"seq_len={T} over --sp {self.size} ranks gives shards of {S} tokens, fewer than the "
                             f"{halo} tokens each rank reads past its shard ({what}); use a seq_len of at least "
                             f"{halo * self.size} or a smaller --sp")

    def to_heads(self, x: Tensor, query_heads: int | None = None) -> Tensor:
        """[B, H, S, Dh] sequence-sharded -> [B, H/N, T, Dh] head-sharded (identity for size 1). For kv heads, pass
        the query heads: kv heads that do not divide over N are first repeated per query head (GQA expanded)."""
        if not self.enabled:
            return x
        if query_heads is not None and x.shape[1] % self.size:
            x = x.repeat_interleave(query_heads // x.shape[1], dim=1)
        self.check_heads(x.shape[1])
        return _Exchange.apply(x, self.size, self.group, True)

    def to_sequence(self, y: Tensor) -> Tensor:
        """[B, H/N, T, Dh] head-sharded -> [B, H, S, Dh] sequence-sharded (identity for size 1)."""
        return _Exchange.apply(y, self.size, self.group, False) if self.enabled else y

    # ----- the halo: point to point from the next rank -----
    def halo_from_next(self, x: Tensor, halo: int) -> Tensor:
        """x [B, S, ...] (this rank's shard) -> [B, h, ...]: the first h = `halo` positions of the next rank's shard
        (h = 0 on the last rank: the row ends there). One point-to-point exchange along the group: every rank but
        the first sends its first `halo` positions to the rank before it, every rank but the last receives its
        successor's. No autograd (the halo carries the frozen target's outputs). `halo` <= S (`check_halo`)."""
        if not self.enabled or halo == 0:
            return x[:, :0]
        if halo > x.shape[1]:
            raise ValueError(f"a halo of {halo} positions is longer than the shard's {x.shape[1]} (check_halo)")
        got = x.new_empty(x.shape[0], halo if self.rank < self.size - 1 else 0, *x.shape[2:])
        ops = []
        if self.rank > 0:
            ops.append(dist.P2POp(dist.isend, x[:, :halo].contiguous(), group=self.group, group_peer=self.rank - 1))
        if self.rank < self.size - 1:
            ops.append(dist.P2POp(dist.irecv, got, group=self.group, group_peer=self.rank + 1))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return got


NO_SP = SequenceParallel()  # no sequence parallelism: one rank holds the whole row


# ----- the frozen target on the shard -----


def target_attention(sp: SequenceParallel, document_ids: Tensor) -> Attend:
    """The frozen target's attention on this rank's shard (`TrainInputs.attend`): q [B, H, S, Dh], k, v
    [B, Hkv, S, Dh] of the shard's tokens go head-sharded over the whole row (`to_heads`), attend causally within
    their document (document_ids [B, T], the whole row's: -1 padding attends to earlier padding, as the target's
    own document mask does) through the tiled `document_prefix_attention` (no [T, T] mask or scores), and come back
    as [B, H, S, Dh] (`to_sequence`). Under no_grad the exchange is a plain all-to-all (no graph is recorded)."""
    T = document_ids.shape[1]
    last = torch.arange(T, device=document_ids.device)[None]  # causal: query i sees keys j <= i
    first = document_first_index(document_ids)  # tiles below a document's start are skipped

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        H = q.shape[1]
        out, _ = document_prefix_attention(sp.to_heads(q), sp.to_heads(k, H), sp.to_heads(v, H), last, document_ids,
                                           document_ids, first)
        return sp.to_sequence(out)

    return attend


@torch.no_grad()
def target_forward(sp: SequenceParallel, target: Decoder, batch: PackedBatch, layer_ids: tuple[int, ...]
                   ) -> DecoderOutput:
    """The frozen target's forward of this rank's shard of `batch` (whole rows): embedding, projections, MLPs and
    final norm on the shard's T/N tokens only, their document-local positions; attention Ulysses over the whole row
    (`target_attention`). -> the taps of `layer_ids` and the final-norm output `last_hidden`, [B, S, D] each, no
    logits (the caller runs the LM head on the shard and its halo). At size 1 the whole row, through the same tiled
    attention."""
    return target(sp.shard(batch.input_ids), TrainInputs(positions=sp.shard(batch.positions), hidden_layers=layer_ids,
                                                         compute_logits=False,
                                                         attend=target_attention(sp, batch.document_ids)))


# ----- block drafters: anchors by owner -----


@dataclass(frozen=True)
class ShardedAnchors:
    """A row batch's valid anchors split by the rank owning their position, each rank's padded to M."""

    local: Tensor  # [R, M] this rank's anchors, as indices into its shard (padding: 0)
    local_valid: Tensor  # [R, M] bool, False on padding
    layout: Tensor  # [R, N·M] every rank's anchors in whole-row positions, rank after rank (the exchanged order)


def shard_anchors(anchors: Tensor, valid: Tensor, sp: SequenceParallel, T: int) -> ShardedAnchors:
    """anchors, valid [R, A] of whole rows (`train.block.row_anchors`) -> `ShardedAnchors`. Every rank computes the
    same layout from the same anchors, so no message is needed; M = the most valid anchors any rank holds in any row
    (at least 1). Padding anchors sit at their rank's first position and are invalid (no loss)."""
    S = T // sp.size
    owner = torch.where(valid, anchors // S, sp.size)  # invalid anchors belong to nobody
    counts = torch.stack([(owner == r).sum(1) for r in range(sp.size)], dim=1)  # [R, N]
    M = max(1, int(counts.max()))
    R = anchors.shape[0]
    layout = torch.zeros(R, sp.size, M, dtype=anchors.dtype, device=anchors.device)
    ok = torch.zeros(R, sp.size, M, dtype=torch.bool, device=anchors.device)
    for r in range(sp.size):
        layout[:, r] = r * S
        for row in range(R):
            mine = anchors[row][owner[row] == r]
            layout[row, r, :len(mine)] = mine
            ok[row, r, :len(mine)] = True
    start = sp.rank * S
    return ShardedAnchors(local=layout[:, sp.rank] - start, local_valid=ok[:, sp.rank], layout=layout.flatten(1))


def block_attention(sp: SequenceParallel, anchors: ShardedAnchors, block_size: int, document_ids: Tensor):
    """The block drafter's training attention under SP (`models.block.drafter.ContextAttention`): this rank's block
    entries q, k, v [R, H|Hkv, M·B, Dh] and its shard's context ctx_k, ctx_v [R, Hkv, S, Dh] -> [R, H, M·B, Dh], through
    `anchored_block_attention` over every rank's anchors and the whole row's context keys (document_ids [R, T])."""
    index = AnchorIndex.build(anchors.layout, block_size, document_ids)

    def attend(q: Tensor, k: Tensor, v: Tensor, ctx_k: Tensor, ctx_v: Tensor) -> Tensor:
        H = q.shape[1]
        out = anchored_block_attention(sp.to_heads(q), sp.to_heads(k, H), sp.to_heads(v, H), sp.to_heads(ctx_k, H),
                                       sp.to_heads(ctx_v, H), index)
        return sp.to_sequence(out)

    return attend


# ----- set-up -----


def init_sequence_parallel(size: int, info: DistInfo, strategy: str) -> SequenceParallel:
    """The SP view of this process for `--sp size`: checks (UsageError, one line) that the run is under torchrun
    with a world size that `size` divides and a strategy that sums gradients over ranks, then creates the SP
    groups (a collective: every rank calls it). size 1: no SP (`dp` = `info`)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise UsageError(f"--sp must be a whole number >= 1, got {size!r}")
    if size == 1:
        return SequenceParallel(dp=info)
    if not info.launched:
        raise UsageError(f"--sp {size} splits each row over {size} processes and needs a torchrun launch: torchrun "
                         f"--nproc_per_node {size} -m angelspec.cli train ... --sp {size}")
    if info.world_size % size:
        raise UsageError(f"--sp {size} does not divide the {info.world_size} processes torchrun started; launch a "
                         f"multiple of {size} (--nproc_per_node)")
    if strategy == "none":
        raise UsageError(f"--sp {size} needs --distributed ddp or fsdp2 (they add up the gradients the SP ranks "
                         "compute), not none")
    group, _ = dist.new_subgroups(group_size=size)
    dp = DistInfo(rank=info.rank // size, local_rank=info.local_rank, world_size=info.world_size // size,
                  device=info.device, launched=True)
    return SequenceParallel(size=size, rank=info.rank % size, group=group, dp=dp)
