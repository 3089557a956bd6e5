"""The block-parallel drafters in the engine (report §3; DSpark report §3): DFlash, DFlare, DFly and DSpark.

One class, `BlockDrafterAdapter`, drafts with any `models.block.BlockDrafter`; it is registered under
the four kinds (`kind` names the folder kind `from_pretrained` loads). Per step it runs ONE backbone pass over
the block `[last, m, …, m]` and then the small sequential head left to right over the first K ≤ B−1 positions
only (`block_propose.BlockProposer.propose`), and returns those K drafts.

Draft context cache convention, per row, whenever a round drafts: the cache holds the injected K/V of every committed
position except the newest token (`cache.lengths == seq_lens − 1`); the newest token is the block's anchor, at position
`seq_lens − 1`. (After a catch-up that left out older missed positions, `resume_window`, the cache holds fewer: its
slots are the positions the drafter sees, and the text runs on across the gap.) Block entries are never cached, so a
step needs no rollback: the a+1 newly committed positions of a step (the old anchor and the a accepted drafts) are
appended from the verify forward's taps, whose hidden states the target has now computed. `on_commit` only keeps those
taps (`PendingCommits`); the next round that drafts appends them first, so a round the speculation gate skips costs
nothing here, and a run of skipped rounds is appended in one call. Before rows change (`prefill`, `reset_rows`) the
cache catches up.

Drafts are the argmax when the engine verifies deterministically or every row is greedy; otherwise they are
sampled from q = process_logits(logits, request temperature / top-k / top-p) with the request's DRAFT noise
(keyed by the draft's position, as every drafter does) and q is returned. Confidences are the model's
(`BlockProposal.confidences`): the confidence head's σ(logit) per draft position (DSpark §3.2) when the drafter
has one, else the head's own (temperature-1) probability of each draft. A "protocol" confidence head (trained on the
acceptance of argmax drafts per sampling temperature, `models.block.heads`) reads each row's request temperature
(`DraftState.sampling.temperature`; idle rows hold 0).

Build it with `BlockDrafterAdapter.from_pretrained(dir, target=...)` (E and W_lm are the target's) or
`BlockDrafterAdapter(model)`. It never loads the target.

Shape legend: B rows, K drafts, V vocab, n verify width.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from angelspec.decoding.compiled import try_compile
from angelspec.decoding.drafters.base import (
    Commit,
    DrafterMismatchError,
    DraftState,
    ModelConfigDrafter,
    PendingCommits,
    Proposal,
)
from angelspec.decoding.drafters.block_propose import BlockProposer
from angelspec.decoding.sampling import NoiseStream, draft_noise_counter, process_logits, sample
from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.block.io import load_block_drafter, read_block_config
from angelspec.models.config import ConfigError, DecoderConfig
from angelspec.models.decoder import Decoder, TrainInputs
from angelspec.models.kv_cache import StaticKVCache
from angelspec.models.mtp import concat_taps


class BlockDrafterAdapter(ModelConfigDrafter):
    """Engine drafter around a `BlockDrafter`. An instance's `kind` is its model's ("dflash", "dflare", "dfly",
    "dspark"); the class attribute is the folder kind `from_pretrained` loads (None here: any block drafter; the
    registered subclasses below each pin theirs, as `Eagle3Drafter` does for the MTP family)."""

    kind: str | None = None
    context_from_commits = True
    # After steps that left the context behind, the newest 32 positions are enough: the shipped DFly drafted as well
    # from the prompt and them as from its whole context (`benchmarks/resume_window.py`).
    resume_window = 32

    def __init__(self, model: BlockDrafter) -> None:
        self.model = model.eval()
        self.proposer = BlockProposer(self.model)  # the drafting loop (`factor_hidden_head` switches its CPU head)
        self.kind = model.config.drafter
        self.target_layer_ids = tuple(model.config.target_layer_ids)
        self.cache: StaticKVCache | None = None
        self._pending = PendingCommits()  # commits whose taps are not in the cache yet
        # Prefill's context append, and the catch-up before rows change, stay eager under `compile`: prefill's row
        # count is the number of requests admitted at once (all rows at the start, then 1, 2, ... as requests
        # finish), a catch-up's width the commits left waiting when a request ended, and each new shape would compile
        # another graph mid-run (what that costs: docs/design.md §12). Bound from the class, so a model another
        # adapter already compiled (its methods shadowed) still runs eagerly here.
        self._eager_append = type(self.model).append_context.__get__(self.model)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, target: Decoder, head: str | None = None) -> BlockDrafterAdapter:
        """Load a block-drafter folder for `target` (the engine's model: its embedding and LM head are shared).
        `head`, when given, must be the folder's head (CheckpointError otherwise). A folder trained for another
        target, whose tap ids the target lacks or whose mask token is outside its vocabulary raises
        DrafterMismatchError before any weight is read."""
        cfg, _ = read_block_config(path, drafter=cls.kind, head=head)
        try:
            cfg.check_target(target.config)
            cfg.check_mask_token(target.config.vocab_size)
        except ConfigError as e:
            raise DrafterMismatchError(f"{path}: {e}") from None
        return cls(load_block_drafter(path, target, drafter=cls.kind, head=head))

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    @property
    def max_draft_tokens(self) -> int:
        """K ≤ B − 1: one backbone pass predicts the block after its anchor."""
        return self.model.config.num_drafts

    @property
    def trained_depth(self) -> int:
        return self.max_draft_tokens

    def check_compatible(self, target: DecoderConfig, max_seq_len: int | None = None,
                         num_draft_tokens: int | None = None) -> None:
        """Tap ids first (the clearest message for a target of another depth), then the fingerprint, the mask
        token, the base checks (vocab, length) and, when given, K ≤ B − 1."""
        try:
            self.model.config.check_target(target)
            self.model.config.check_mask_token(target.vocab_size)
        except ConfigError as e:
            raise DrafterMismatchError(f"{type(self).__name__}: {e}") from None
        super().check_compatible(target, max_seq_len)
        if num_draft_tokens is not None:
            self.check_depth(num_draft_tokens)

    def check_depth(self, k: int) -> None:
        """Raise DrafterMismatchError unless 0 ≤ k ≤ B − 1."""
        if not 0 <= k <= self.max_draft_tokens:
            raise DrafterMismatchError(
                f"a {self.kind} drafter with block size {self.block_size} proposes at most {self.max_draft_tokens} "
                f"drafts per step, but {k} were asked for: set num_draft_tokens <= {self.max_draft_tokens} or "
                "train a drafter with a larger block_size")

    # ----- engine life cycle -----
    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:
        w = next(self.model.parameters())
        c = self.cache
        if c is None or c.batch_size != batch_size or c.capacity < max_len + slack:
            self.cache = None  # free the old buffers before allocating the new ones
            self.cache = self.model.new_cache(batch_size, max_len, slack=slack, dtype=w.dtype, device=device)
        self.cache.reset()
        self._pending.clear()
        self.model.rope_table(self.model.rope_size(self.cache), self.cache.dtype)  # eagerly, outside compiled calls

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                target_hidden: tuple[Tensor, ...]) -> None:
        cache = self.cache
        assert cache is not None, "allocate() before prefill()"
        idx = torch.as_tensor(list(rows), dtype=torch.int64, device=cache.device)  # [n]
        lengths = torch.as_tensor([len(p) for p in prompts], dtype=torch.int64, device=cache.device)  # [n]
        cache.lengths[idx] = 0
        # Context = the P prompt positions; the first emitted token (position P) is the first anchor.
        if not self.defer_prefill:
            self._catch_up(eager=True)  # the rows' waiting commits belong to the requests that left them
            self._eager_append(concat_taps(target_hidden), cache, num_new=lengths, rows=idx)
            return
        # Deferred like a commit: the rows' waiting entries belong to the requests that left them (dropped), and the
        # prompt's taps wait, scattered into all B rows, for the next round that drafts (`PendingCommits`): while the
        # speculation gate runs plain steps a joining request costs the drafter nothing.
        self._pending.drop_rows(rows)
        b = cache.batch_size
        taps = []
        for t in target_hidden:  # [n, P_max, D] -> [B, P_max, D]
            full = t.new_zeros(b, *t.shape[1:])
            full[idx] = t
            taps.append(full)
        host = [0] * b  # new entries per row: the joining rows' prompt lengths
        for r, p in zip(rows, prompts, strict=True):
            host[r] = len(p)
        self._pending.add(taps, torch.tensor(host, dtype=torch.int64, device=cache.device), host)

    def propose(self, state: DraftState) -> Proposal:
        cache, k = self.cache, state.num_draft_tokens
        assert cache is not None, "allocate() before propose()"
        self.check_depth(k)
        if k == 0:
            empty = torch.zeros(state.seq_lens.shape[0], 0, dtype=torch.int64, device=state.seq_lens.device)
            return Proposal(tokens=empty, confidences=empty.float(), deterministic=True)
        deterministic = state.deterministic or state.all_greedy
        if deterministic:
            return self._greedy_round(state)
        self._catch_up()
        s = state.sampling

        def select(logits: Tensor, j: int) -> tuple[Tensor, Tensor]:
            q = process_logits(logits, s.temperature, s.top_k, s.top_p, filtering=s.filtering)  # [B, V]
            counter = draft_noise_counter(state.seq_lens + j, state.draft_round)
            return sample(q, s.seeds, counter, NoiseStream.DRAFT), q

        p = self.proposer.propose(state.last_tokens, cache, kv_len=state.seq_len_bound, select=select, num_drafts=k,
                                  with_logits=False, temperature=s.temperature)
        return Proposal(tokens=p.tokens, probs=p.probs, confidences=p.confidences, deterministic=False)

    # False: a greedy round's catch-up and its drafting pass run as two calls (`benchmarks/joined_calls.py` measures
    # one against the other; same drafts either way).
    join_catch_up = True
    # True: a joining request's prompt taps wait with the commits for the next round that drafts, and the rows of a
    # request that left drop their waiting entries (no catch-up forced by admissions). False: appended at once.
    defer_prefill = True

    def _greedy_round(self, state: DraftState) -> Proposal:
        """Argmax drafts: the waiting commits' context append and the drafting pass as ONE call (`caught_up_step`,
        one compiled graph under `compile`: at batch 1 on a CPU a call's fixed cost is a good share of the step),
        or the drafting pass alone when nothing waits."""
        cache, m = self.cache, self.model
        assert cache is not None
        self.proposer.refresh_inference_tables()  # outside any compiled graph
        waiting = self._pending.take()
        args = (state.last_tokens, cache, state.seq_len_bound, state.num_draft_tokens, False,
                state.sampling.temperature)
        if waiting is not None and not self.join_catch_up:  # two calls: the append, then the drafting pass
            m.append_context(concat_taps(waiting[0]), cache, num_new=waiting[1])
            waiting = None
        if waiting is None:
            tokens, _, _, conf = self.proposer.greedy_propose(*args)
        else:
            hidden, count = waiting
            tokens, conf = self.caught_up_step(concat_taps(hidden), count, *args)
        return Proposal(tokens=tokens, confidences=conf, deterministic=True)

    def caught_up_step(self, taps: Tensor, count: Tensor, anchor_tokens: Tensor, cache: StaticKVCache, kv_len: int,
                       num_drafts: int, with_logits: bool, temperature: Tensor) -> tuple[Tensor, Tensor]:
        """Append the waiting commits' taps [B, T, n·C] (`count` [B] new positions per row) to the context, then
        draft greedily from it -> (tokens [B, K], confidences [B, K]); tensors only."""
        # Under `compile` these calls are compiled too; traced into this graph, they run as one.
        self.model.append_context(taps, cache, num_new=count)
        tokens, _, _, conf = self.proposer.greedy_propose(anchor_tokens, cache, kv_len, num_drafts, with_logits,
                                                          temperature)
        return tokens, conf

    def on_commit(self, commit: Commit) -> None:
        # The verify forward's taps at [last, d_1..d_n]: the old anchor and the accepted drafts become context, at
        # the next round that drafts (`_catch_up`).
        self._pending.add(commit.target_hidden, *commit.new_counts())

    def _catch_up(self, eager: bool = False) -> None:
        """Append every waiting commit's new positions to the context cache, in one call. `eager`: outside any
        compiled call (before rows change: once per admission)."""
        waiting = self._pending.take()
        if waiting is not None:
            assert self.cache is not None
            hidden, count = waiting
            append = self._eager_append if eager else self.model.append_context
            append(concat_taps(hidden), self.cache, num_new=count)

    def reset_rows(self, rows: Sequence[int]) -> None:
        assert self.cache is not None
        if self.defer_prefill:  # the rows' waiting entries belong to the requests that left: no one's context now
            self._pending.drop_rows(rows)
        else:
            self._catch_up(eager=True)
        self.cache.reset_rows(list(rows))

    def compile(self) -> None:
        """The whole greedy step (backbone pass and head) as one graph, the backbone pass alone for sampled
        drafts (whose head runs eagerly around `select`), and the context append of the commits' catch-up (instance
        attributes shadow the methods, so the adapter picks them up). Prefill's append stays eager (`__init__`)."""
        m, p = self.model, self.proposer
        p.greedy_propose = try_compile(p.greedy_propose, f"{self.kind} greedy step")  # type: ignore[method-assign]
        m.backbone_step = try_compile(m.backbone_step, f"{self.kind} backbone pass")  # type: ignore[method-assign]
        m.append_context = try_compile(m.append_context, f"{self.kind} context append")  # type: ignore[method-assign]
        self.caught_up_step = try_compile(self.caught_up_step,  # type: ignore[method-assign]
                                          f"{self.kind} context append + greedy step")


def _block_kind(kind: str, class_name: str, doc: str) -> type[BlockDrafterAdapter]:
    """The registered adapter of one block-drafter kind: the kinds differ only in what the saved folder holds
    (conditioning and head come from its config), so each is `BlockDrafterAdapter` with its name."""
    cls = type(class_name, (BlockDrafterAdapter,), {"kind": kind, "__doc__": doc, "__module__": __name__})
    return cls


DFlashDrafter = _block_kind("dflash", "DFlashDrafter", "DFlash (report Eq. 10): shared fc context, no sequential head.")
DFlareDrafter = _block_kind("dflare", "DFlareDrafter",
                            "DFlare (report Eq. 11): per-draft-layer softmax fusion over the target taps.")
DFlyDrafter = _block_kind("dfly", "DFlyDrafter",
                          "DFly (report Eq. 12, 14–15): hybrid conditioning with a Markov or hidden-correction head.")
DSparkDrafter = _block_kind("dspark", "DSparkDrafter",
                            "DSpark (DSpark report §3): the DFlash backbone (same-layer injection or the shared fused "
                            "context), a Markov-family head and the confidence head.")


@torch.no_grad()
def reference_drafts(model: BlockDrafter, target: Decoder, sequence: Sequence[int], k: int) -> list[int]:
    """Slow reference for greedy `propose`: from scratch, a target forward over the committed `sequence`, its taps
    at positions 0..s−2 as the context and the newest token as the anchor (`BlockProposer.propose_from_taps`)."""
    ids = torch.tensor([list(sequence)], device=target.embed_tokens.weight.device)  # [1, s]
    s = ids.shape[1]
    hidden = target(ids, TrainInputs(hidden_layers=list(model.config.target_layer_ids), compute_logits=False)).hidden
    taps = concat_taps(hidden)[:, : s - 1]  # [1, s−1, n·C]
    lengths = torch.tensor([s - 1], device=ids.device)
    return BlockProposer(model).propose_from_taps(taps, lengths, ids[:, -1]).tokens[0, :k].tolist()
