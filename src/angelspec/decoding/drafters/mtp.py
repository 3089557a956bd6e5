"""The shared-parameter MTP drafter (report §2.1): K recurrent invocations of one MTP draft model per step.

The model needs the target's tap hidden state at committed positions (it declares `target_layer_ids`),
and shares the target's embedding and LM head: build it with `MTPDrafter.from_pretrained(dir, target=...)`
(or `MTPDrafter(model)` around a model built on the target's modules). It never loads the target.

Draft KV cache convention, per row, whenever a round drafts (docs/design.md trap 4): the cache holds exactly the
depth-0 entries of the committed positions 0..s-2 (s = committed length), entry j being Eq. 1–2 applied to
(target tap h_j, E(x_{j+1})) at RoPE position j, and `_h_last` holds the model's output h^(0) at entry s-2,
whose head predicts x_s (the first draft). A drafting round then appends draft-chain entries for depths
1..K-1 at slots s-1.. (positions s-2+k), which is exactly the TTT pattern of training (causal prefix of
depth-0 keys + the round's diagonal keys). `on_commit` truncates the chain away and keeps the commit
(`PendingCommits`); the next round that drafts first appends the new depth-0 entries of the newly committed
positions (a+1 per step) from the verify forwards' taps in one ragged forward, so rounds the speculation gate
skips cost nothing here and are caught up together. Before rows change (`prefill`, `reset_rows`) the cache
catches up.

K may exceed the trained depth D: the model is simply invoked again (recurrently).

The same code drafts with every MTP-family model: committed entries are built from `model.condition(taps)`
(MTP: the one tap; EAGLE-3: fc over three, `decoding.drafters.eagle3`), draft-chain entries from the model's own
previous output, exactly as in the TTT rollout of training.

Drafts are the argmax when the engine verifies deterministically or every row is greedy; otherwise they are
sampled from q = process_logits(logits, request temperature / top-k / top-p) with the request's DRAFT noise
and q is returned. Confidences are the model's own (temperature-1) probability of each draft. A model with a
draft vocabulary (`draft_vocab_size`, `angelspec draft-vocab`) multiplies only those LM-head rows and drafts
only those ids (q is 0 elsewhere).

Shape legend: B rows, K draft depth, C model dim, V vocab, n verify width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from angelspec.decoding.batching import pad_prompts
from angelspec.decoding.compiled import try_compile
from angelspec.decoding.drafters.base import (
    Commit,
    DrafterMismatchError,
    DraftState,
    ModelConfigDrafter,
    PendingCommits,
    Proposal,
)
from angelspec.decoding.sampling import NoiseStream, draft_noise_counter, process_logits, sample
from angelspec.models.config import ConfigError, DecoderConfig
from angelspec.models.decoder import Decoder
from angelspec.models.kv_cache import StaticKVCache
from angelspec.models.mtp import MTPDraftModel, concat_taps
from angelspec.models.mtp_io import load_mtp, read_mtp_config


class MTPDrafter(ModelConfigDrafter):
    """Drafts with any MTP-family model (`MTPDraftModel` or a subclass); `kind` is the folder kind `from_pretrained`
    loads (`Eagle3Drafter` only changes it)."""

    kind = "mtp"
    context_from_commits = True
    # After steps that left the context behind, the newest 32 positions are enough (`benchmarks/resume_window.py`).
    resume_window = 32
    # False: a one-row greedy round's catch-up and its K depths run as two calls (`benchmarks/joined_calls.py`
    # measures one against the other; same drafts either way).
    join_catch_up = True

    def __init__(self, model: MTPDraftModel) -> None:
        self.model = model.eval()
        self.target_layer_ids = tuple(model.config.target_layer_ids)
        self.cache: StaticKVCache | None = None
        self._one_row_chain = self.greedy_chain  # a one-row greedy round (`compile`: one graph)
        self._one_row_round = self.caught_up_round  # the same with its catch-up (`compile`: one graph)
        self._k = 0
        self._bound = 1
        self._pending = PendingCommits()  # commits whose depth-0 entries are not in the cache yet
        self._pending_bound = 1  # `_bound` when the oldest of them was proposed
        # Prefill's cached forward, and the catch-up before rows change, stay eager under `compile`: their shapes
        # are the admitted rows and their longest prompt (or the commits left waiting when a request ended), new at
        # almost every admission, and each would compile another graph mid-run (docs/design.md §12). Bound from the
        # class, so a model another adapter already compiled still runs eagerly here.
        self._eager_forward = type(self.model).forward_cached.__get__(self.model)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, target: Decoder) -> MTPDrafter:
        """Load a folder of this drafter's kind for `target` (the engine's model: its embedding and LM head are
        shared). A folder trained for another target, or whose tap ids the target does not have, raises
        DrafterMismatchError before anything is built."""
        cfg, _ = read_mtp_config(path, cls.kind)
        try:
            cfg.check_target(target.config)
        except ConfigError as e:
            raise DrafterMismatchError(f"{path}: {e}") from None
        return cls(load_mtp(path, target, kind=cls.kind))

    @property
    def trained_depth(self) -> int:
        """D, the depths the model was unrolled over in training (MTP-3: 3)."""
        return self.model.config.num_depths

    def check_compatible(self, target: DecoderConfig, max_seq_len: int | None = None) -> None:
        super().check_compatible(target, max_seq_len)
        if target.hidden_size != self.model.config.hidden_size:
            raise DrafterMismatchError(f"MTPDrafter has hidden size {self.model.config.hidden_size}, the target "
                                       f"{target.hidden_size}")

    # ----- engine life cycle -----
    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:
        w = next(self.model.parameters())
        c = self.cache
        if c is None or c.batch_size != batch_size or c.capacity < max_len + slack:
            self.cache = None
            self.cache = self.model.new_cache(batch_size, max_len, slack=slack, dtype=w.dtype, device=device)
        self.cache.reset()
        self._h_last = torch.zeros(batch_size, self.model.config.hidden_size, dtype=w.dtype, device=device)  # [B, C]
        self._base = torch.zeros(batch_size, dtype=torch.int64, device=device)  # [B] committed entries
        self._pending.clear()
        self.model.rope_table(self.cache.capacity, self.cache.dtype)  # eagerly, outside compiled calls

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                target_hidden: tuple[Tensor, ...]) -> None:
        cache = self.cache
        assert cache is not None
        self._catch_up(eager=True)  # the rows' waiting commits belong to the requests that left them
        taps = self.model.condition(concat_taps(target_hidden).to(cache.dtype))  # [n, P_max, C]
        # Entry j fuses h_j with x_{j+1}: the prompt shifted by one, then the first emitted token.
        ids, lengths = pad_prompts([list(p[1:]) + [f] for p, f in zip(prompts, first_tokens, strict=True)],
                                   cache.device)  # [n, P_max], [n]
        n, p_max = ids.shape
        tmp = self.model.new_cache(n, p_max, slack=0, dtype=cache.dtype, device=cache.device)
        out = self._eager_forward(taps, ids, tmp, num_new=lengths, kv_len=p_max)  # [n, P, C]
        idx = torch.as_tensor(list(rows), dtype=torch.int64, device=cache.device)
        cache.k[0][idx, :, :p_max] = tmp.k[0]
        cache.v[0][idx, :, :p_max] = tmp.v[0]
        cache.lengths[idx] = lengths
        self._h_last[idx] = out[torch.arange(n, device=out.device), lengths - 1]

    def propose(self, state: DraftState) -> Proposal:
        cache, k = self.cache, state.num_draft_tokens
        assert cache is not None
        if k == 0:
            self._k, self._bound = k, state.seq_len_bound
            empty = torch.zeros(state.seq_lens.shape[0], 0, dtype=torch.int64, device=state.seq_lens.device)
            return Proposal(tokens=empty, confidences=empty.float(), deterministic=True)
        deterministic = state.deterministic or state.all_greedy
        act = state.active.long()
        s = state.sampling
        model = self.model
        model.refresh_draft_vocab()  # outside any compiled call
        self._k, self._bound = k, state.seq_len_bound
        if deterministic and cache.batch_size == 1 and self._pending and self.join_catch_up:
            # one row: the waiting commits' depth-0 entries and the round's K depths as ONE call (one graph)
            (*hidden, committed), count = self._pending.take()
            self._base = cache.lengths + count  # where this round's draft chain starts, after the catch-up
            tokens_t, conf_t, self._h_last = self._one_row_round(concat_taps(hidden), committed, count,
                                                                 self._pending_bound, self._h_last, cache, act,
                                                                 state.seq_len_bound, k)
            return Proposal(tokens=tokens_t, confidences=conf_t, deterministic=True)
        self._catch_up()
        self._base = cache.lengths.clone()
        if deterministic:
            chain = self._one_row_chain if cache.batch_size == 1 else self.greedy_chain
            tokens_t, conf_t = chain(self._h_last, cache, act, state.seq_len_bound, k)
            return Proposal(tokens=tokens_t, confidences=conf_t, deterministic=True)
        h = self._h_last  # [B, C]
        logits = model.draft_head(h)  # [B, V'], depth 0 (V' = V without a draft vocabulary)
        tokens, probs, confs = [], [], []
        for j in range(k):
            q = process_logits(model.full_logits(logits), s.temperature, s.top_k, s.top_p,  # [B, V]
                               filtering=s.filtering)
            d = sample(q, s.seeds, draft_noise_counter(state.seq_lens + j, state.draft_round), NoiseStream.DRAFT)
            idx = model.to_draft_index(d)  # q is 0 outside the draft vocabulary
            probs.append(q)
            confs.append(torch.softmax(logits, dim=-1).gather(1, idx[:, None])[:, 0])
            tokens.append(d)
            if j < k - 1:
                h = self._depth_step(h, d, cache, act, state.seq_len_bound + j)
                logits = model.draft_head(h)
        return Proposal(tokens=torch.stack(tokens, dim=1), probs=torch.stack(probs, 1),
                        confidences=torch.stack(confs, dim=1), deterministic=False)

    def _depth_step(self, h: Tensor, d: Tensor, cache: StaticKVCache, act: Tensor, kv_len: int) -> Tensor:
        """Depth j+1 of a drafting round: the entry at slot s-1+j (position s-2+(j+1)) fuses h^(j) [B, C] with
        the draft d_j [B] -> h^(j+1) [B, C]."""
        return self.model.forward_cached(h[:, None], d[:, None], cache, num_new=act, kv_len=kv_len)[:, 0]

    def greedy_chain(self, h: Tensor, cache: StaticKVCache, act: Tensor, bound: int, k: int
                     ) -> tuple[Tensor, Tensor]:
        """The K argmax drafts of a round from h^(0) [B, C] -> (tokens [B, K], confidences [B, K]: each draft's
        own probability), tensors only.

        Under `compile` a one-row round runs as this one graph: at batch 1 the per-call cost dominates. With more
        rows each depth is its own graph (`greedy_depth`, compiled too): a graph that writes the cache and then
        reads it back copies the whole cache, which costs more than the calls it saves from a few rows up
        (`benchmarks/drafter_cost.py --compile --drafters mtp`; numbers: docs/design.md §12)."""
        tokens, confs = [], []
        for j in range(k):
            d, conf, h = self.greedy_depth(h, cache, act, bound + j, j < k - 1)
            tokens.append(d)
            confs.append(conf)
        return torch.stack(tokens, dim=1), torch.stack(confs, dim=1)

    def greedy_depth(self, h: Tensor, cache: StaticKVCache, act: Tensor, kv_len: int, advance: bool
                     ) -> tuple[Tensor, Tensor, Tensor]:
        """One depth of a greedy round, tensors only: the argmax draft d [B] of h [B, C], its probability [B],
        and (when `advance`) the next depth's h, whose cache entry it writes (else h unchanged). One cache write
        per call keeps a compiled graph's update of the cache in place."""
        model = self.model
        logits = model.draft_head(h)  # [B, V'] (V' = V without a draft vocabulary)
        idx = logits.argmax(dim=-1)  # [B] along the draft vocabulary
        d = model.to_target_ids(idx)
        conf = torch.softmax(logits, dim=-1).gather(1, idx[:, None])[:, 0]
        return d, conf, (self._depth_step(h, d, cache, act, kv_len) if advance else h)

    def on_commit(self, commit: Commit) -> None:
        cache = self.cache
        assert cache is not None
        if self._k:
            cache.truncate(self._base)  # drop this round's draft chain: trap 4
        if not self._pending:
            self._pending_bound = self._bound
        # last, d_1..d_n as the target saw them, and the committed tokens: depth-0 entries at the next drafted round
        count, host = commit.new_counts()  # [B] new committed positions per row
        self._pending.add((*commit.target_hidden, commit.tokens), count, host)

    def _catch_up(self, eager: bool = False) -> None:
        """Append the depth-0 entries of every waiting commit's new positions (one ragged forward) and set `_h_last`
        of the rows that had any. `eager`: outside any compiled call (before rows change: once per admission)."""
        waiting = self._pending.take()
        if waiting is None:
            return
        assert self.cache is not None
        (*hidden, tokens), count = waiting  # count [B]: new committed positions per row
        self._h_last = self.append_commits(concat_taps(hidden), tokens, count, self._pending_bound, self._h_last,
                                           self.cache, forward=self._eager_forward if eager else None)

    def append_commits(self, taps: Tensor, tokens: Tensor, count: Tensor, bound: int, h_last: Tensor,
                       cache: StaticKVCache, forward: Callable[..., Tensor] | None = None) -> Tensor:
        """The depth-0 entries of committed positions: taps [B, T, n·C] of the verify forwards' inputs as the target
        saw them, with the committed tokens [B, T] and `count` [B] new positions per row, appended to `cache`
        (`bound`: the longest row's length before them) -> h^(0) [B, C], the newest entry of each row that had
        any (`h_last` for the others); tensors only. `forward`: the model's cached forward to run (default: as
        compiled)."""
        # [B, T, C]: conditioned (EAGLE-3: fc over three taps)
        taps = self.model.condition(taps.to(cache.dtype))
        width = taps.shape[1]
        keep = torch.arange(width, device=count.device)[None, :] < count[:, None]  # [B, T]
        tok = torch.where(keep, tokens, 0)  # x_{j+1}: accepted drafts then the bonus; placeholders -> 0
        forward = self.model.forward_cached if forward is None else forward
        out = forward(taps, tok, cache, num_new=count, kv_len=bound + width)  # [B, T, C]
        newest = out.gather(1, (count - 1).clamp(0, width - 1)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]
        return torch.where((count > 0)[:, None], newest, h_last)

    def caught_up_round(self, taps: Tensor, tokens: Tensor, count: Tensor, pending_bound: int, h_last: Tensor,
                        cache: StaticKVCache, act: Tensor, bound: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """`append_commits` then `greedy_chain`: a one-row round with its catch-up -> (tokens [B, K], confidences
        [B, K], the new h^(0) [B, C]); tensors only, one graph under `compile`."""
        h = self.append_commits(taps, tokens, count, pending_bound, h_last, cache)
        drafts, conf = self.greedy_chain(h, cache, act, bound, k)
        return drafts, conf, h

    def compile(self) -> None:
        """A one-row greedy round as one graph, each depth of a larger greedy round as one graph (head, argmax
        and the next depth's cached forward; `greedy_chain` says why), and the model's cached forward (commit,
        sampled rounds) and its LM head (instance attributes shadow the methods). Prefill stays eager (`__init__`)."""
        self._one_row_chain = try_compile(self.greedy_chain, f"{self.kind} greedy round")
        self._one_row_round = try_compile(self.caught_up_round, f"{self.kind} catch-up + greedy round")
        self.greedy_depth = try_compile(self.greedy_depth, f"{self.kind} greedy depth")  # type: ignore[method-assign]
        m = self.model
        m.forward_cached = try_compile(m.forward_cached, f"{self.kind} cached forward")  # type: ignore[method-assign]
        m.draft_head = try_compile(m.draft_head, f"{self.kind} head")  # type: ignore[method-assign]

    def reset_rows(self, rows: Sequence[int]) -> None:
        assert self.cache is not None
        self._catch_up(eager=True)
        self.cache.reset_rows(list(rows))
