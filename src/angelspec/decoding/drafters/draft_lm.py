"""An independent small draft LM (same tokenizer as the target): K autoregressive steps of a small
`Decoder` with its own static KV cache per proposal.

Cache convention, per row, after every commit: the draft cache holds the committed sequence except its
newest token (like the target's), or except its newest two when the target accepted all K drafts (the
K-th draft was proposed but never fed back). `propose` therefore starts with one forward of two tokens,
[pending, last] or [last, pad] (ragged via num_new), then K-1 forwards of one token: K forwards per step.
`on_commit` rolls the cache back to the committed tokens (docs/design.md trap 4).

Drafts are the argmax when the engine verifies deterministically or every row is greedy; otherwise they
are sampled from q = process_logits(draft logits, the request's temperature / top-k / top-p) with the
request's DRAFT noise, and q is returned for standard speculative sampling. Confidences are the draft
model's own (temperature-1) probability of each draft token.

Draft vocabulary (`draft_vocab`, written by `angelspec draft-vocab`): drafts only from those target ids, so
each draft step multiplies only their LM-head rows (for a 1-layer draft LM the LM head is most of its cost);
logits are then [B, V'] and sampled drafts see −inf outside the set.

Early stop (`stop_below`, default 0.4, as HF's assisted generation): with argmax drafts, a row's proposal
ends at its first draft whose confidence is below the threshold (that draft included), and drafting stops as
soon as every active row has ended: unlikely drafts cost neither draft forwards nor verified positions. The
row lengths go out as `Proposal.lengths`; they depend on the drafts' values, which only the deterministic
protocol (and greedy verification) allows (docs/design.md trap 1), so sampled drafts always run all K steps.

Shape legend: B rows, K draft depth, V vocab.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import Tensor

from angelspec.decoding.batching import prefill_rows
from angelspec.decoding.compiled import try_compile
from angelspec.decoding.drafters.base import Commit, Drafter, DraftState, Proposal, switched
from angelspec.decoding.sampling import NoiseStream, draft_noise_counter, process_logits, sample
from angelspec.models.decoder import CacheInputs, Decoder
from angelspec.models.hf_io import load_target
from angelspec.models.kv_cache import StaticKVCache
from angelspec.models.linear import lay_out_weights as lay_out_linear_weights
from angelspec.models.linear import linear
from angelspec.models.vocab import expand_logits


class DraftLMDrafter(Drafter):
    def __init__(self, model: Decoder, *, target_fingerprint: str | None = None,
                 stop_below: float | None = 0.4, draft_vocab: Sequence[int] | Tensor | None = None) -> None:
        if stop_below is not None and not 0.0 <= stop_below <= 1.0:
            raise ValueError(f"stop_below must be a confidence in [0, 1] or None (never stop early), got {stop_below}")
        self.model = model.eval()
        self.stop_below = stop_below
        w = model.lm_head.weight
        self.draft_vocab: Tensor | None = None
        if draft_vocab is not None:  # drafts only from these target ids: only their LM-head rows are multiplied
            ids = torch.as_tensor(draft_vocab, dtype=torch.int64).flatten().cpu()  # checked on the host, then moved
            v = model.config.vocab_size
            if not ids.numel() or ids.unique().numel() != ids.numel() or not bool(((ids >= 0) & (ids < v)).all()):
                raise ValueError(f"draft_vocab must be distinct token ids in [0, {v}), got {ids.numel()} ids "
                                 f"({ids.unique().numel()} distinct)")
            self.draft_vocab = ids.to(w.device)
        self._head = self._head_rows()
        self._target_fingerprint = target_fingerprint
        self.cache: StaticKVCache | None = None
        self._k = 0
        self._first_fn, self._step_fn = self._first_logits, self._step_logits

    def _head_rows(self) -> Tensor:
        """The LM-head rows drafts are scored with: [V', D] (all V rows without a draft vocabulary)."""
        w = self.model.lm_head.weight.detach()
        return w if self.draft_vocab is None else w[self.draft_vocab.to(w.device)]

    def _first_logits(self, tokens: Tensor, cache: StaticKVCache, num_new: Tensor, kv_len: int,
                      index: Tensor) -> Tensor:
        """tokens [B, 2] = [pending or last, last] -> the logits [B, V'] (draft vocabulary) at position index
        [B, 1]."""
        inputs = CacheInputs(cache, num_new=num_new, kv_len=kv_len, compute_logits=False)
        h = self.model.forward_cached(tokens, inputs).last_hidden
        return linear(h.gather(1, index[..., None].expand(-1, -1, h.shape[-1]))[:, 0], self._head).float()

    def _step_logits(self, tokens: Tensor, cache: StaticKVCache, num_new: Tensor, kv_len: int) -> Tensor:
        """tokens [B, 1] -> next-token logits [B, V'] (draft vocabulary)."""
        inputs = CacheInputs(cache, num_new=num_new, kv_len=kv_len, compute_logits=False)
        h = self.model.forward_cached(tokens, inputs).last_hidden
        return linear(h[:, 0], self._head).float()

    def _full(self, logits: Tensor) -> Tensor:
        """[B, V'] -> [B, V], −inf outside the draft vocabulary."""
        if self.draft_vocab is None:
            return logits
        return expand_logits(logits, self.draft_vocab, self.model.config.vocab_size)

    def lay_out_weights(self, prepack: bool = True) -> None:
        lay_out_linear_weights(self.model, prepack)

    def compile(self) -> None:
        self._first_fn = try_compile(self._first_logits, "draft LM's first step")
        self._step_fn = try_compile(self._step_logits, "draft LM's step")

    def full_depth(self) -> AbstractContextManager[None]:
        """No early stop inside (`Drafter.full_depth`)."""
        return switched(self, "stop_below", None)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", stop_below: float | None = 0.4) -> DraftLMDrafter:
        """Load a HF-layout causal-LM folder. An optional `"angelspec": {"target_fingerprint": ..., "draft_vocab":
        [ids]}` entry (the draft vocabulary from `angelspec draft-vocab`) in
        its config.json ties it to the target it was trained for."""
        model = load_target(path, dtype=dtype, device=device)
        raw = json.loads((Path(path) / "config.json").read_text())
        meta = raw.get("angelspec") or {}
        return cls(model, target_fingerprint=meta.get("target_fingerprint"), stop_below=stop_below,
                   draft_vocab=meta.get("draft_vocab"))

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...] | None:
        return self.model.config.eos_token_ids or None

    @property
    def target_fingerprint(self) -> str | None:
        return self._target_fingerprint

    @property
    def max_positions(self) -> int:
        return self.model.config.max_position_embeddings

    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:
        c = self.cache
        if c is None or c.batch_size != batch_size or c.capacity < max_len + slack + 1:
            self.cache = None
            w = self.model.embed_tokens.weight
            self.cache = StaticKVCache(self.model.config, batch_size, max_len, slack=slack + 1, dtype=w.dtype,
                                       device=w.device)
        self.cache.reset()
        w = self.model.lm_head.weight
        if (self._head.dtype, self._head.device) != (w.dtype, w.device):  # the model was moved or cast
            self._head = self._head_rows()
        self._pending = torch.zeros(batch_size, dtype=torch.int64, device=device)  # [B] K-th draft, not cached
        self._has_pending = torch.zeros(batch_size, dtype=torch.bool, device=device)  # [B]
        self._base = torch.zeros(batch_size, dtype=torch.int64, device=device)  # [B] lengths before propose

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                target_hidden: tuple[Tensor, ...]) -> None:
        assert self.cache is not None
        prefill_rows(self.model, self.cache, rows, prompts, compute_logits=False)
        self._has_pending[torch.as_tensor(list(rows), dtype=torch.int64, device=self._has_pending.device)] = False

    def propose(self, state: DraftState) -> Proposal:
        cache, k = self.cache, state.num_draft_tokens
        assert cache is not None
        b = state.seq_lens.shape[0]
        self._k = k
        deterministic = state.deterministic or state.all_greedy
        self._base = cache.lengths.clone()
        act = state.active.long()  # [B] idle rows append nothing
        last = state.last_tokens
        first_in = torch.stack([torch.where(self._has_pending, self._pending, last), last], dim=1)  # [B, 2]
        pend = self._has_pending.long()
        # Cache length before = seq_len - 1 - pending, so kv_len = seq_len + 1 bounds every row.
        logits = self._first_fn(first_in, cache, (1 + pend) * act, state.seq_len_bound + 1, pend[:, None])  # [B, V]
        if k == 0:  # a round without drafts (the speculation gate): the cache now holds every committed token
            empty = torch.zeros(b, 0, dtype=torch.int64, device=state.seq_lens.device)
            return Proposal(tokens=empty, confidences=empty.float(), deterministic=True)
        s = state.sampling
        tokens, probs, confs = [], [], []
        early = self.stop_below is not None and deterministic
        lengths = torch.full_like(act, k)  # [B] drafts worth verifying per row
        ended = ~state.active  # [B] rows whose proposal is complete (idle rows never draft)
        vocab = self.draft_vocab
        for j in range(k):
            if deterministic:
                i = logits.argmax(dim=-1)  # [B] index along the draft vocabulary
                d = i if vocab is None else vocab[i]
                conf = torch.softmax(logits, dim=-1).gather(1, i[:, None])[:, 0]
            else:
                q = process_logits(self._full(logits), s.temperature, s.top_k, s.top_p,  # [B, V]
                                   filtering=s.filtering)
                counters = draft_noise_counter(state.seq_lens + j, state.draft_round)  # draft j at seq_len + j
                d = sample(q, s.seeds, counters, NoiseStream.DRAFT)
                probs.append(q)
                conf = torch.softmax(self._full(logits), dim=-1).gather(1, d[:, None])[:, 0]
            confs.append(conf)
            tokens.append(d)
            if early and j < k - 1:
                low = ~ended & (confs[-1] < self.stop_below)
                lengths = torch.where(low, j + 1, lengths)
                ended = ended | low
                if bool(ended.all()):  # host sync, once per draft step: stop when every row has ended
                    pad = k - 1 - j
                    tokens += [d] * pad  # valid ids, never verified (lengths)
                    confs += [torch.zeros_like(confs[-1])] * pad
                    break
            if j < k - 1:
                logits = self._step_fn(d[:, None], cache, act, state.seq_len_bound + j + 2)
        tok = torch.stack(tokens, dim=1)  # [B, K]
        self._lengths = lengths
        # The last proposed draft of each row: never fed back when the proposal ended before the loop did.
        self._pending = tok.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
        return Proposal(tokens=tok, probs=None if deterministic else torch.stack(probs, dim=1),
                        confidences=torch.stack(confs, dim=1), lengths=lengths if early else None,
                        deterministic=deterministic)

    def on_commit(self, commit: Commit) -> None:
        cache, k = self.cache, self._k
        assert cache is not None
        if k == 0:  # propose fed the row's last token and nothing else: all but the newest committed token cached
            cache.truncate(torch.where(commit.active, commit.seq_lens - 1, self._base))
            self._has_pending = torch.where(commit.active, False, self._has_pending)
            return
        # All of a row's drafts accepted: the last one is committed but may never have been fed (it was when the
        # row ended before the loop did; it is then fed again, harmlessly), so it becomes the pending token.
        pending = commit.active & (commit.num_accepted == self._lengths)
        cache.truncate(torch.where(commit.active, commit.seq_lens - 1 - pending.long(), self._base))
        self._has_pending = torch.where(commit.active, pending, self._has_pending)

    def reset_rows(self, rows: Sequence[int]) -> None:
        idx = torch.as_tensor(list(rows), dtype=torch.int64, device=self._has_pending.device)
        self._has_pending[idx] = False
