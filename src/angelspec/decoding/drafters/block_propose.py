"""The block family's drafting loop: one backbone pass of a `models.block.BlockDrafter` over the block, then its
sequential head left to right over the draft positions (report §3.2 Eq. 13), picking each draft by argmax or by the
caller's selection rule (`Select`), and the CPU-only factored form of the hidden-correction head (Eq. 15) for greedy
steps of few rows. The model holds the maths (`backbone_step`, `head_step`, `head_logits`, the context cache's
`new_cache` / `append_context`); `BlockProposer` drives it, as `mtp.MTPDrafter` drives an MTP model's
`forward_cached`. `block.BlockDrafterAdapter` puts it in the engine.

Shape legend: B rows, K = B_blk − 1 draft positions, C model dim, V vocab, V' draft vocabulary, I head width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.block.heads import HiddenCorrectionHead, MarkovHead
from angelspec.models.kv_cache import StaticKVCache
from angelspec.models.linear import linear, transposed_copy
from angelspec.models.mtp import concat_taps

FACTORED_HEAD_MAX_BYTES = 64 << 20  # the largest tables `BlockProposer.factored_head` builds
FACTORED_HEAD_MAX_ROWS = 2  # and the most rows a step may have to run it (beyond, FLOPs, not bytes, bound a step)

# Selection rule for `propose`: (logits [B, V] fp32, draft index k) -> (tokens [B] int64, probs [B, V] or None).
Select = Callable[[Tensor, int], tuple[Tensor, Tensor | None]]


@dataclass(frozen=True)
class BlockProposal:
    """`propose`'s result: K = B−1 drafts per row, left to right through the head."""

    tokens: Tensor  # [B, K] int64 target token ids
    logits: Tensor | None  # [B, K, V'] fp32, the head's logits given the chosen predecessors, over the draft
    #                        vocabulary (V' = draft_vocab_size; V when the drafter drafts from the whole vocabulary);
    #                        may be None when `propose(with_logits=False)` (the engine's greedy steps)
    probs: Tensor | None  # [B, K, V] what `select` sampled from (None for greedy), over the whole vocabulary
    confidences: Tensor  # [B, K] in [0, 1], per position (not cumulative): σ(confidence logits) with a confidence
    #                      head (a "protocol" head's at each row's sampling temperature), else each draft's own
    #                      probability under the head's temperature-1 logits
    token_index: Tensor  # [B, K] each draft's index along `logits`' last dim (= tokens without a draft vocabulary)


class BlockProposer:
    """Drafts with a `BlockDrafter`: `propose` (argmax or a `Select` rule), its tensors-only greedy form
    `greedy_propose` (one compiled graph under the engine's `compile`), and the slow references. The factored
    hidden-correction head's tables are cached on the model (`DraftVocabulary.derived`), rebuilt when a weight or
    the draft vocabulary changes.

    factor_hidden_head: greedy drafting runs the hidden-correction head in its factored form when `factored_head()`
    allows it; False: the plain per-position head (A/B benchmarks)."""

    def __init__(self, model: BlockDrafter, factor_hidden_head: bool = True) -> None:
        self.model = model
        self.factor_hidden_head = factor_hidden_head

    def propose(self, anchor_tokens: Tensor, cache: StaticKVCache, *, kv_len: int | None = None,
                select: Select | None = None, num_drafts: int | None = None, with_logits: bool = True,
                temperature: Tensor | None = None) -> BlockProposal:
        """One backbone pass over the whole block, then the head (Eq. 13) over its first `num_drafts` positions
        (default and at most K = B−1): -> that many drafts per row.

        `select(logits [B, V], k)` picks draft k from the head's logits and returns (tokens [B], probs [B, V] or
        None); default: argmax (deterministic drafts), which runs as `greedy_propose`, tensors only, so that
        `compile` makes the whole step one graph. The chosen token is the predecessor of draft k+1.
        `with_logits=False` lets a greedy step skip forming logits it does not need (the factored head's, when a
        confidence head gives the confidences): `logits` may then be None. `temperature` [B]: each row's sampling
        temperature, which a "protocol" confidence head reads (None = 0, greedy)."""
        if select is None:
            self.refresh_inference_tables()  # outside any compiled graph
            tokens, logits, index, conf = self.greedy_propose(anchor_tokens, cache, kv_len, num_drafts, with_logits,
                                                              temperature)
            return BlockProposal(tokens=tokens, logits=logits, probs=None, confidences=conf, token_index=index)
        k = self._num_drafts(num_drafts)
        z = self.model.backbone_step(anchor_tokens, cache, kv_len)[:, 1: k + 1]  # [B, K, C]
        tokens, logits, index, probs, conf = self._run_head(z, anchor_tokens, select, temperature=temperature)
        return BlockProposal(tokens=tokens, logits=logits, probs=probs, confidences=conf, token_index=index)

    def greedy_propose(self, anchor_tokens: Tensor, cache: StaticKVCache, kv_len: int | None = None,
                       num_drafts: int | None = None, with_logits: bool = True, temperature: Tensor | None = None
                       ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """`propose` with argmax drafts, tensors only: -> (tokens [B, K], logits [B, K, V'] (or None: see
        `propose`), index [B, K], confidences [B, K]) for K = `num_drafts` (default B−1)."""
        k = self._num_drafts(num_drafts)
        z = self.model.backbone_step(anchor_tokens, cache, kv_len)[:, 1: k + 1]  # [B, K, C]
        tokens, logits, index, _, conf = self._run_head(z, anchor_tokens, None, with_logits, temperature)
        return tokens, logits, index, conf

    def _run_head(self, z: Tensor, anchor_tokens: Tensor, select: Select | None, with_logits: bool = True,
                  temperature: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, Tensor]:
        """The head over backbone outputs z [B, K, C], left to right in its predecessors -> (tokens [B, K],
        logits [B, K, V'] (None only when not `with_logits` and not needed), index [B, K], probs [B, K, V] or None,
        confidences [B, K]).

        Only what depends on the predecessor runs per position; everything else runs for the whole block at once:
        the backbone's logits W_lm RMSNorm(z) (no head: they are the drafts' logits; a Markov-family head adds its
        rank-r bias to them per position), and the hidden-correction head's W_z RMSNorm(z) half (its W_e half, the
        final norm and the LM head over the draft vocabulary run per position: the predecessor goes through them,
        Eq. 15; greedy steps of few rows on CPU run it factored instead, `_factored_hidden`). Confidences: the
        confidence head's σ(logit) when the drafter has one (at the rows' sampling temperatures `temperature` [B], for
        a "protocol" head), else each draft's own probability under the head's (temperature-1) logits."""
        m = self.model
        head = m.head
        h = m.norm(z)  # [B, K, C]
        if head is None:
            logits = m.draft_logits(h)  # [B, K, V'] the drafts do not depend on each other
            index, tokens, probs = self._pick(logits, select, 0)
        elif select is None and self.factored_head(z.shape[0]):
            logits, index = self._factored_hidden(z, anchor_tokens, with_logits or not m.config.confidence_head)
            tokens, probs = m.to_target_ids(index), None
        else:
            hidden = isinstance(head, HiddenCorrectionHead)
            if hidden:
                zg = head.z_part(z)  # [B, K, 2I]
                state = None
            else:
                assert isinstance(head, MarkovHead)
                base = m.draft_logits(h)  # [B, K, V']
                state = head.init_state(anchor_tokens.shape, z)
            prev = anchor_tokens
            cols: list[tuple[Tensor, Tensor, Tensor, Tensor | None]] = []
            for k in range(z.shape[1]):
                if hidden:
                    lg = m.draft_logits(m.norm(head.step(z[:, k], zg[:, k], m.embed(prev))))  # Eq. 15
                else:
                    u, state = head.features(h[:, k], prev, state)
                    lg = base[:, k] + m.draft_bias(u).float()  # Eq. 14 / DSpark §3.1
                idx, tok, p = self._pick(lg[:, None], select, k)
                prev = tok[:, 0]
                cols.append((lg, idx[:, 0], prev, None if p is None else p[:, 0]))
            logits = torch.stack([c[0] for c in cols], dim=1)
            index = torch.stack([c[1] for c in cols], dim=1)
            tokens = torch.stack([c[2] for c in cols], dim=1)
            probs = None if any(c[3] is None for c in cols) else torch.stack([c[3] for c in cols], dim=1)
        if m.config.confidence_head:
            prev_all = torch.cat([anchor_tokens[:, None], tokens[:, :-1]], dim=1)  # [B, K]
            temps = None if temperature is None else temperature[:, None]  # [B, 1]: one per row, every position
            conf = torch.sigmoid(m.confidence(h, m.markov_embed(prev_all), temps).float())
        else:
            conf = torch.softmax(logits, dim=-1).gather(-1, index[..., None])[..., 0]
        return tokens, logits, index, probs, conf

    def _num_drafts(self, n: int | None) -> int:
        """K: `n` drafts (default B−1), checked against the block."""
        k = self.model.config.num_drafts
        if n is None:
            return k
        if not 1 <= n <= k:
            raise ValueError(f"a block of {self.model.config.block_size} proposes 1..{k} drafts, {n} were asked for")
        return n

    def _pick(self, logits: Tensor, select: Select | None, start: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Drafts at positions start.. from logits [B, n, V'] (draft vocabulary): argmax over all at once, or
        `select` per position (its draft index k = start + j) on the logits over the whole vocabulary
        -> (index along V' [B, n], target ids [B, n], probs [B, n, V] or None)."""
        if select is None:
            index = logits.argmax(dim=-1)
            return index, self.model.to_target_ids(index), None
        picks = [select(self.model.full_logits(logits[:, j]), start + j) for j in range(logits.shape[1])]
        tokens = torch.stack([t for t, _ in picks], dim=1)
        probs = None if any(p is None for _, p in picks) else torch.stack([p for _, p in picks], dim=1)
        return self.model.to_draft_index(tokens), tokens, probs  # sampled ids lie in the draft vocabulary

    def factored_head(self, rows: int = 1) -> bool:
        """Whether greedy drafting of `rows` rows runs the hidden-correction head factored (`_factored_hidden`):
        a CPU drafter whose tables (`_factored_tables`) take at most FACTORED_HEAD_MAX_BYTES, for at most
        FACTORED_HEAD_MAX_ROWS rows. At batch 1 on CPU a step costs the weight bytes it reads, and the factored
        head reads one [I, V'] table and one T_e row per draft position instead of W_e, W_down and the LM-head
        rows; but it multiplies V'-wide twice per position (W' z_k and the table), so with more rows, where FLOPs
        bound the step, the plain head is faster (`benchmarks/drafter_cost.py --drafters dfly,dfly-plain`). On an
        accelerator the per-position products are cheap and the tables not worth their memory."""
        head = self.model.head
        if not (self.factor_hidden_head and isinstance(head, HiddenCorrectionHead)) or rows > FACTORED_HEAD_MAX_ROWS:
            return False
        w = head.down_proj.weight
        cfg = self.model.config
        v_draft = cfg.draft_vocab_size or cfg.vocab_size
        # W', Mᵀ; T_e and, with a draft vocabulary, its rows T_e'
        elements = v_draft * (head.hidden + head.inter) + (cfg.vocab_size + cfg.draft_vocab_size) * 2 * head.inter
        return w.device.type == "cpu" and elements * w.element_size() <= FACTORED_HEAD_MAX_BYTES

    def _factored_tables(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The hidden-correction head's inference tables, over the draft vocabulary V' (the whole vocabulary
        without one) and, for T_e, over the whole vocabulary (the anchor, a predecessor too, may lie outside V'),
        cached until a weight or the vocabulary changes (taken as they are inside a compiled graph, like the
        vocabulary rows: `refresh_inference_tables` runs eagerly first):

            W' = W_lm[V'] diag(γ)         [V', C]   γ: the final RMSNorm's weight
            Mᵀ = (W' W_down)ᵀ             [I, V']
            T_e = W_e RMSNorm_e(E)        [V, 2I]   the predecessor's half of the gate/up projection, per token
            T_e' = T_e[V']                [V', 2I]  the same rows by draft index (T_e itself without a vocabulary),
                                                    so a draft's argmax index picks its successor's row directly"""
        m = self.model
        head = m.head
        assert isinstance(head, HiddenCorrectionHead)
        emb, lm = m.target_weights()
        vocab = (m.draft_vocab,) if m.config.draft_vocab_size else ()

        def build() -> tuple[Tensor, Tensor, Tensor, Tensor]:
            rows = m._vocab_weights()[0] if vocab else lm.detach()
            w_lm = transposed_copy(rows * m.norm.weight)  # multiplied by a block of rows (`models.linear`)
            m_t = (w_lm @ head.down_proj.weight).t().contiguous()
            t_e = linear(head.e_norm(emb.detach()), head.gate_up_proj.weight[:, head.hidden:]).contiguous()
            return w_lm, m_t, t_e, t_e[m.draft_vocab] if vocab else t_e

        return m.derived("factored head", (lm, emb, *vocab, m.norm.weight, head.e_norm.weight,
                                           head.gate_up_proj.weight, head.down_proj.weight), build)

    def refresh_inference_tables(self) -> None:
        """Bring the draft vocabulary's rows and the factored head's tables up to date, outside any compiled
        graph (`propose` calls it before every step)."""
        self.model.refresh_draft_vocab()
        if self.factored_head():
            self._factored_tables()

    def _factored_hidden(self, z: Tensor, anchor_tokens: Tensor, with_logits: bool = True
                         ) -> tuple[Tensor | None, Tensor]:
        """Greedy drafts of the hidden-correction head (Eq. 15) over z [B, K, C], factored -> (logits [B, K, V']
        fp32 or, without `with_logits`, None; index [B, K] along V'). With a_k = SiLU(g_k) ⊙ u_k,
        [g_k; u_k] = W_z RMSNorm(z_k) + W_e RMSNorm(E(x_{k−1})), ẑ_k = z_k + W_down a_k and r_k = 1 / rms(ẑ_k):

            logits_k = W_lm RMSNorm(ẑ_k) = r_k (W' z_k + (W' W_down) a_k)

        W' z_k runs for the whole block at once; per position only the predecessor's row of T_e, the SwiGLU and
        one [I]x[I, V'] product remain, and since r_k > 0 the argmax needs no norm: six kernel calls per position,
        the draft's own index picking the next row (T_e', no mapping to target ids inside the loop). r_k and the
        logits are formed after the loop. The same maths as `head_step`, rounded differently."""
        head = self.model.head
        assert isinstance(head, HiddenCorrectionHead)
        w_lm, m_t, t_e, t_e_draft = self._factored_tables()
        z = z.contiguous()  # a slice of the block: as a strided 3-D input, F.linear becomes a per-row bmm
        K = z.shape[1]
        zg = head.z_part(z).unbind(1)  # K x [B, 2I]
        base = linear(z, w_lm).unbind(1)  # K x [B, V'] W' z_k
        row = t_e.index_select(0, anchor_tokens)  # [B, 2I] the predecessor's T_e row: the anchor's, then a draft's
        acts, scores, picks = [], [], []
        for k in range(K):
            gate, up = (zg[k] + row).split(head.inter, dim=-1)  # [B, I] each
            a = F.silu(gate) * up  # [B, I]
            s = torch.addmm(base[k], a, m_t)  # [B, V'] = W' ẑ_k
            acts.append(a)
            scores.append(s)
            picks.append(s.argmax(dim=-1))  # [B] along V'
            if k + 1 < K:
                row = t_e_draft.index_select(0, picks[-1])
        if not with_logits:
            return None, torch.stack(picks, dim=1)
        z_hat = z + head.down_proj(torch.stack(acts, dim=1))  # [B, K, C]
        wide = torch.promote_types(z.dtype, torch.float32)  # RMSNorm's precision
        r = torch.rsqrt(z_hat.to(wide).pow(2).mean(-1, keepdim=True) + self.model.norm.eps)
        return (torch.stack(scores, dim=1).to(wide) * r).float(), torch.stack(picks, dim=1)

    @torch.no_grad()
    def reference_propose(self, anchor_tokens: Tensor, cache: StaticKVCache, *, kv_len: int | None = None,
                          select: Select | None = None, temperature: Tensor | None = None) -> BlockProposal:
        """Slow reference for `propose`: the whole head strictly left to right, one position (one LM-head call,
        `head_step`) at a time, as Eq. 13 reads."""
        m = self.model
        z = m.backbone_step(anchor_tokens, cache, kv_len)[:, 1:]  # [B, K, C]
        state = m.head.init_state(anchor_tokens.shape, z) if isinstance(m.head, MarkovHead) else None
        prev = anchor_tokens
        index, tokens, logits_out, probs, confs = [], [], [], [], []
        for k in range(m.config.num_drafts):
            logits, conf, state = m.head_step(z[:, k], prev, state, temperature)
            idx, tok, p = self._pick(logits[:, None], select, k)
            index.append(idx[:, 0])
            tokens.append(tok[:, 0])
            logits_out.append(logits)
            probs.append(None if p is None else p[:, 0])
            confs.append(torch.softmax(logits, dim=-1).gather(-1, idx)[:, 0] if conf is None
                         else torch.sigmoid(conf.float()))
            prev = tok[:, 0]
        return BlockProposal(
            tokens=torch.stack(tokens, dim=1), logits=torch.stack(logits_out, dim=1),
            probs=None if any(p is None for p in probs) else torch.stack(probs, dim=1),
            confidences=torch.stack(confs, dim=1), token_index=torch.stack(index, dim=1))

    @torch.no_grad()
    def propose_from_taps(self, taps: Sequence[Tensor] | Tensor, lengths: Tensor, anchor_tokens: Tensor,
                          select: Select | None = None) -> BlockProposal:
        """Stateless convenience (tests, references): context = taps [B, T, n·C] (or the n taps) of positions
        0..lengths[b]−1, anchor at position lengths[b]."""
        taps = taps if isinstance(taps, Tensor) else concat_taps(taps)
        B, T, _ = taps.shape
        cache = self.model.new_cache(B, max(T, 1), slack=0, dtype=taps.dtype, device=taps.device)
        if T:
            self.model.append_context(taps, cache, num_new=lengths)
        return self.propose(anchor_tokens, cache, kv_len=T, select=select)
