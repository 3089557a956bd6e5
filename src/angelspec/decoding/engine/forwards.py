"""The target's forwards the engine runs, as one table: each variant is eager, or compiled when
`EngineConfig.compile` is on, and the speculative ones are warmed up (compiled) before a run needs them.

    variant               tokens            returns                                   used by
    decode                [B, 1]            logits [B, V]                             the AR step; a step without
                                                                                    drafts whose taps nobody needs
    one_token             [B]               logits [B, V], taps                       a speculative step without drafts
    verify                [B, n+1]          logits [B, n+1, V], taps                  sampled verification, equal depths
    greedy_verify         [B, n+1]          tokens [B, n+1], num_accepted [B], taps   greedy verification, equal depths
    packed_verify         [B, n+1] (kept)   logits [B, n+1, V], taps                  sampled, ragged depths / idle rows
    greedy_packed_verify  [B, n+1] (kept)   tokens, num_accepted, taps                greedy, ragged depths / idle rows

`tokens` = [last, d_1..d_n] per row; taps are the drafter's hidden-state taps of the target. The greedy variants
accept inside the forward's call, so that compiled, the acceptance joins the forward's graph. The packed variants
run only the positions a row verifies (`CacheInputs.keep`). Every variant is a function of its own: dynamo keeps
one list of compiled graphs per function, and checks their guards in turn on every call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from angelspec.decoding.compiled import try_compile
from angelspec.decoding.sampling import greedy_accept
from angelspec.models.decoder import CacheInputs, Decoder, DecoderOutput
from angelspec.models.kv_cache import StaticKVCache

Taps = tuple[Tensor, ...]
# variant -> (what a compile failure's warning names, the engines that run it: "ar" without a drafter, "spec" with one)
VARIANTS: dict[str, tuple[str, tuple[Literal["ar", "spec"], ...]]] = {
    "decode": ("decode step", ("ar", "spec")),
    "one_token": ("one-token verify forward", ("spec",)),
    "verify": ("verify forward", ("spec",)),
    "greedy_verify": ("greedy verify step", ("spec",)),
    "packed_verify": ("packed verify forward", ("spec",)),
    "greedy_packed_verify": ("packed greedy verify step", ("spec",)),
}
# What `TargetForwards.warm_up` ran, per target and taps: the compiled graphs live in dynamo's cache, per function
# and guarded on shapes (duck sizing off: any cache capacity), which every engine over the same target shares; a new
# engine (one per batch shape in a server, one per run in a benchmark) need not run them again, which would cost a
# few verify forwards at the start of every run. (Not with CUDA graphs: those are recorded on an engine's own cache
# buffers, so each engine warms its own.)
_WARMED: weakref.WeakKeyDictionary[Decoder, dict[tuple[int, ...], set[tuple[int, str]]]] = weakref.WeakKeyDictionary()


class TargetForwards:
    """`VARIANTS` over one target; with compile, each variant the engine runs is replaced by its compiled twin
    (`compiled.try_compile`, captured as CUDA graphs when cuda_graphs). `warmed` records which step graphs `warm_up`
    compiled: (batch kind: 1, or 2 for larger batches; "plain" / "greedy" / "sampled"), shared by every engine over
    the same target with the same taps (their compiled graphs are the same), without CUDA graphs."""

    def __init__(self, target: Decoder, taps: tuple[int, ...], *, speculative: bool, compile: bool,
                 cuda_graphs: bool) -> None:
        self.target, self.taps, self.compiled, self.cuda_graphs = target, taps, compile, cuda_graphs
        self.warmed: set[tuple[int, str]] = set()
        if not cuda_graphs:  # (CUDA graphs are recorded on each engine's own buffers: each engine warms its own)
            self.warmed = _WARMED.setdefault(target, {}).setdefault(taps, set())
        mode = "spec" if speculative else "ar"
        for name, (what, used_by) in VARIANTS.items():
            if compile and mode in used_by:
                setattr(self, name, try_compile(getattr(self, name), what, cuda_graphs=cuda_graphs))

    def decode(self, last: Tensor, cache: StaticKVCache, num_new: Tensor, kv_len: int) -> Tensor:
        """last [B] -> next-token logits [B, V]; the cache grows by num_new [B] (0 for idle rows)."""
        out = self.target.forward_cached(last[:, None], CacheInputs(cache, num_new=num_new, kv_len=kv_len))
        return out.logits[:, 0]

    def one_token(self, last: Tensor, cache: StaticKVCache, kv_len: int, num_new: Tensor) -> tuple[Tensor, Taps]:
        """A step without drafts (last [B], the newest committed token per row): `decode` plus the taps -> logits
        [B, V], taps; the cache grows by num_new [B] (1 for active rows, 0 for idle). It takes and returns what
        `decode` does (compiled, what is made or sliced outside the graph is host work every step); the taps cost a
        compiled plain step a few percent more than `decode` (benchmarks/plain_step.py)."""
        out = self.target.forward_cached(last[:, None], CacheInputs(cache, num_new=num_new, kv_len=kv_len,
                                                                    hidden_layers=self.taps))
        return out.logits[:, 0], out.hidden

    def verify(self, tokens: Tensor, cache: StaticKVCache, kv_len: int) -> tuple[Tensor, Taps]:
        """tokens [B, n+1] -> logits [B, n+1, V] and the taps; the cache grows by n+1."""
        out = self.target.forward_cached(tokens, CacheInputs(cache, kv_len=kv_len, hidden_layers=self.taps))
        return out.logits, out.hidden

    def greedy_verify(self, tokens: Tensor, cache: StaticKVCache, kv_len: int, depth: Tensor
                      ) -> tuple[Tensor, Tensor, Taps]:
        """`verify` and greedy acceptance of at most depth [B] drafts per row: -> tokens [B, n+1] (accepted drafts,
        then the target's token, then placeholders), num_accepted [B], the taps."""
        out = self.target.forward_cached(tokens, CacheInputs(cache, kv_len=kv_len, hidden_layers=self.taps))
        v = greedy_accept(tokens[:, 1:], out.logits, depth)
        return v.tokens, v.num_accepted, out.hidden

    def packed_verify(self, tokens: Tensor, cache: StaticKVCache, kv_len: int, depth: Tensor, active: Tensor,
                      num_keep: int) -> tuple[Tensor, Taps]:
        """`verify` over only the positions a row verifies (its first depth + 1, none for idle rows), packed densely;
        num_keep = their host-side count. Logits and taps of the other positions are zeros; the cache grows by n+1
        per row (roll back to the kept length)."""
        out = self._packed(tokens, cache, kv_len, depth, active, num_keep)
        return out.logits, out.hidden

    def greedy_packed_verify(self, tokens: Tensor, cache: StaticKVCache, kv_len: int, depth: Tensor, active: Tensor,
                             num_keep: int) -> tuple[Tensor, Tensor, Taps]:
        """`packed_verify` and greedy acceptance (positions past a row's depth are never compared, so their zero
        logits do not matter)."""
        out = self._packed(tokens, cache, kv_len, depth, active, num_keep)
        v = greedy_accept(tokens[:, 1:], out.logits, depth)
        return v.tokens, v.num_accepted, out.hidden

    def _packed(self, tokens: Tensor, cache: StaticKVCache, kv_len: int, depth: Tensor, active: Tensor,
                num_keep: int) -> DecoderOutput:
        keep = (torch.arange(tokens.shape[1], device=tokens.device)[None, :] <= depth[:, None]) & active[:, None]
        return self.target.forward_cached(tokens, CacheInputs(cache, kv_len=kv_len, hidden_layers=self.taps, keep=keep,
                                                              num_keep=num_keep))

    def warm_up(self, cache: StaticKVCache, k: int, *, greedy: bool, sampled: bool, packed: bool,
                decode: bool = False) -> None:
        """Compile the speculative step's graphs for the cache's batch before the run, on dummy inputs (the outputs are
        thrown away and the cache emptied again), rather than the first time a step needs one, mid-run. torch.compile
        specialises a batch of 1, so batch 1 and larger batches get graphs each; later depths and batch sizes reuse them
        (dynamic sizes), but for depth 1 (two tokens a row: the greedy acceptance's guards tell it apart), warmed too,
        since a serving policy narrows the depth to 1 mid-run. Compiled: the step without drafts (and with `decode` the
        decode step, for steps without drafts whose taps nobody needs: `ServingGate.keep_taps`), and the verify graphs
        at depth K and 1, dense and (packed, more than one row) packed; greedy ones when the run has a request at T = 0,
        sampled ones when it has one at T > 0 (a step is greedy only when all its rows are). The target's RoPE table is
        built first, eagerly: a graph traced before it existed would guard on its absence (docs/design.md section 9)."""
        b, dev = cache.batch_size, cache.device
        kind = min(b, 2)
        wanted = {"plain": True, "decode": decode, "greedy": greedy and k > 0, "sampled": sampled and k > 0}
        todo = [w for w in ("plain", "decode", "greedy", "sampled") if wanted[w] and (kind, w) not in self.warmed]
        if not self.compiled or not todo:
            return
        self.target.rope_table(cache.capacity, dev)
        drafts = torch.zeros(b, k + 1, dtype=torch.int64, device=dev)
        full = torch.full((b,), k, dtype=torch.int64, device=dev)
        ragged = full.clone()
        ragged[1:] = 0
        active = torch.ones(b, dtype=torch.bool, device=dev)
        packed = packed and b > 1
        one_ragged = ragged.clamp(max=1)
        one, short = full.clamp(max=1), drafts[:, :2].contiguous()  # depth 1: two tokens a row
        runs: dict[str, list[Callable[[], object]]] = {
            "plain": [lambda: self.one_token(torch.zeros(b, dtype=torch.int64, device=dev), cache, 2,
                                             torch.ones(b, dtype=torch.int64, device=dev))],
            "decode": [lambda: self.decode(torch.zeros(b, dtype=torch.int64, device=dev), cache,
                                           torch.ones(b, dtype=torch.int64, device=dev), 2)],
            "greedy": [lambda: self.greedy_verify(drafts, cache, k + 1, full)]
            + ([lambda: self.greedy_verify(short, cache, 2, one)] if k > 1 else [])
            + ([lambda: self.greedy_packed_verify(drafts, cache, k + 1, ragged, active, k + b)] if packed else [])
            + ([lambda: self.greedy_packed_verify(short, cache, 2, one_ragged, active, 1 + b)] if packed and k > 1
               else []),
            "sampled": [lambda: self.verify(drafts, cache, k + 1)]
            + ([lambda: self.verify(short, cache, 2)] if k > 1 else [])
            + ([lambda: self.packed_verify(drafts, cache, k + 1, ragged, active, k + b)] if packed else [])
            + ([lambda: self.packed_verify(short, cache, 2, one_ragged, active, 1 + b)] if packed and k > 1 else []),
        }
        with torch.inference_mode():
            for what in todo:
                for run in runs[what]:
                    run()
                    cache.reset()
                self.warmed.add((kind, what))
