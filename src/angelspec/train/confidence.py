"""What the block drafters' confidence head is trained on, and the drafter a confidence-only run starts from.

Targets (`confidence_targets`). The depth policies that read confidences (D-cut, Algorithm 1, the threshold) make the
engine verify the drafter's ARGMAX drafts with the deterministic-draft protocol (`decoding.sampling.
verify_deterministic`, docs/design.md trap 1), so the acceptance of draft k given an accepted prefix is

    T = 0   1[x = argmax p]          (greedy verification)
    T > 0   p_T(x) = softmax(p_logits / T)[x]                    with x = argmax q over the draft vocabulary

where p is the target's distribution at that position and q the drafter's. A "protocol" head
(`BlockDrafterConfig.confidence_target`) has one output per temperature T_j of its grid and is fitted to these
targets at every T_j on every anchor (the targets of all T_j come from the same teacher logits, so no temperature
needs to be drawn). A "tv" head (DSpark §3.2, and every folder written before the option) is fitted to
α = 1 − TV(p, q), the acceptance of STANDARD speculative sampling of a draft sampled from q at T = 1 — which is not
what any confidence-driven policy verifies.

x is the draft inference would propose: the argmax over the drafter's draft vocabulary when it has one (under
train_vocab "full" training scores the whole vocabulary, inference only the draft vocabulary's rows; under "draft"
the student logits cover only those rows, `draft_columns`), mapped back to target ids. A "tv" head's α under
train_vocab "draft" is the draft space's (`train.losses.to_draft_space`): q is zero outside the draft vocabulary.
The student logits are the teacher-forced ones (the predecessor is the clean token), as for α. Top-k / top-p
sampling is not modelled: with top-p < 1 the target's p_T(x) after truncation is somewhat larger than the head
predicts.

Confidence-only runs (`confidence_only_drafter`): the drafter of an existing block-drafter folder, its backbone and
head frozen, the confidence head (and the confidence head's own W1, when it has one) trainable. A "tv" head or a
protocol head of another grid warm-starts every output from the old head's confidence at that output's temperature;
a folder without a confidence head gets a fresh one.

Shape legend: M valid (anchor, position) rows, V vocab, n grid temperatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from angelspec.models.block.config import BlockDrafterConfig
from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.block.heads import temperature_weights
from angelspec.models.block.io import load_block_drafter, read_block_config
from angelspec.models.config import ConfigError
from angelspec.models.decoder import Decoder
from angelspec.train.losses import draft_space_student, draft_space_teacher, token_alpha

# Parameters a confidence-only run trains: the head's projection and, for heads without a Markov W1, its own W1.
CONFIDENCE_PARAMETERS = ("confidence.", "confidence_embed.")


def argmax_drafts(student_logits: Tensor, draft_vocab: Tensor | None = None, *, draft_columns: bool = False) -> Tensor:
    """The drafts inference proposes: student logits [M, V] over the whole vocabulary -> target ids [M], the argmax
    over the draft vocabulary `draft_vocab` [V'] (target ids) when given, else over all of V. `draft_columns`: the
    logits are [M, V'] over `draft_vocab`'s ids already (train_vocab "draft")."""
    if draft_vocab is None:
        return student_logits.argmax(dim=-1)
    if draft_columns:
        return draft_vocab[student_logits.argmax(dim=-1)]
    return draft_vocab[student_logits.index_select(-1, draft_vocab).argmax(dim=-1)]


@torch.no_grad()
def protocol_acceptance(student_logits: Tensor, teacher_logits: Tensor, temperatures: Sequence[float],
                        draft_vocab: Tensor | None = None, *, draft_columns: bool = False) -> Tensor:
    """The acceptance of the argmax draft x under the deterministic-draft protocol, per temperature (module
    docstring): student / teacher logits [M, V] -> [M, n] float32 (float64 for float64 logits), column j =
    1[x = argmax p] for T_j = 0, p_{T_j}(x) for T_j > 0. `draft_columns`: as `argmax_drafts`."""
    x = argmax_drafts(student_logits, draft_vocab, draft_columns=draft_columns)[:, None]  # [M, 1]
    p = teacher_logits.detach().to(torch.promote_types(teacher_logits.dtype, torch.float32))
    cols = []
    for t in temperatures:
        if t == 0:
            cols.append((p.argmax(dim=-1, keepdim=True) == x).to(p.dtype))
        else:
            cols.append(F.log_softmax(p / t, dim=-1).gather(-1, x).exp())
    return torch.cat(cols, dim=-1)


@torch.no_grad()
def confidence_targets(config: BlockDrafterConfig, student_logits: Tensor, teacher_logits: Tensor, mask: Tensor,
                       top_k: int | None = None, draft_vocab: Tensor | None = None, *,
                       draft_columns: bool = False) -> Tensor:
    """What `config`'s confidence head is fitted to at every (anchor, position): logits [N, K, V], mask [N, K] ->
    [N, K] α = 1 − TV on the teacher's top-`top_k` support ("tv") or [N, K, n] (`protocol_acceptance`,
    "protocol"); 0 where the mask is False. `draft_columns` (train_vocab "draft"): the student logits are
    [N, K, V'] over `draft_vocab`'s ids, and α is the draft space's."""
    # Every (anchor, position) row, the masked ones zeroed afterwards: static shapes, no host sync (no `x[mask]`).
    s, t = student_logits.flatten(0, 1), teacher_logits.flatten(0, 1)  # [N·K, V]
    if config.confidence_target == "tv":
        if draft_columns:
            s, t = draft_space_student(s), draft_space_teacher(t, draft_vocab)
        rows = token_alpha(s, t, top_k)  # [N·K]
    else:
        rows = protocol_acceptance(s, t, config.confidence_temperatures, draft_vocab,
                                   draft_columns=draft_columns)  # [N·K, n]
    rows = rows.view(*mask.shape, *rows.shape[1:])
    return torch.where(mask.view(*mask.shape, *([1] * (rows.dim() - 2))), rows, 0.0)


def is_confidence_parameter(name: str) -> bool:
    """Whether the drafter parameter `name` belongs to the confidence head (what a confidence-only run trains)."""
    return name.startswith(CONFIDENCE_PARAMETERS)


def warm_start_outputs(weight: Tensor, old: Sequence[float], new: Sequence[float]) -> Tensor:
    """A confidence projection's rows (weight [n_old, W] or bias [n_old]) for a head with grid `new`, each new row
    the old head's logit at its temperature: the one "tv" row (`old` empty) copied, else interpolated over `old`
    as the head does at inference. A "tv" head (`new` empty) reads the old head at T = 1."""
    if not old:
        return weight[:1].expand(max(1, len(new)), *weight.shape[1:]).clone()
    points = torch.tensor(list(new) or [1.0], device=weight.device)
    mix = temperature_weights(points, old).to(weight.dtype)  # [n_new, n_old]
    return mix @ weight


def new_block_drafter(cfg: BlockDrafterConfig, target: Decoder, *, seed: int, init_std: float) -> BlockDrafter:
    """A block drafter of `cfg` around `target`'s embedding and LM head, initialised (`init_weights` with `seed`, drawn
    on the host so every device starts from the same weights) and moved to the target's device in float32: the
    master weights a run trains (a 16-bit target's run computes under autocast; pure bf16 weights would lose AdamW's
    small updates below their rounding step), and what a run from a folder loads its weights into."""
    model = BlockDrafter(cfg, target.embed_tokens, target.lm_head)
    model.init_weights(std=init_std, generator=torch.Generator().manual_seed(seed))
    return model.to(device=target.embed_tokens.weight.device, dtype=torch.float32)


def init_from_drafter(folder: str | Path, target: Decoder, *, kind: str) -> BlockDrafter:
    """The block drafter an `init_from` run starts from, loaded for `target`; ConfigError (naming the --drafter to
    pass) for a folder of another kind, the loaders' errors for one of another target or not a block drafter."""
    source_cfg, _ = read_block_config(folder)
    if source_cfg.drafter != kind:
        raise ConfigError(f"init_from={folder} holds a {source_cfg.drafter} drafter, not {kind}: pass --drafter "
                          f"{source_cfg.drafter}")
    return load_block_drafter(folder, target, drafter=kind)


def confidence_only_drafter(folder: str | Path, target: Decoder, *, kind: str, confidence_target: str,
                            temperatures: Sequence[float], seed: int, init_std: float) -> BlockDrafter:
    """The drafter in `folder` (a block drafter of `kind` trained for `target`) with a confidence head of
    `confidence_target` / `temperatures`, on the target's device and dtype, everything but the confidence head
    frozen (`requires_grad` False). Raises ConfigError for a folder of another kind or target (the loaders'
    CheckpointError for a folder that is not a block drafter)."""
    source = init_from_drafter(folder, target, kind=kind)
    source_cfg = source.config
    cfg = replace(source_cfg, confidence_head=True, confidence_target=confidence_target,
                  confidence_temperatures=tuple(temperatures) if confidence_target == "protocol" else ())
    model = new_block_drafter(cfg, target, seed=seed, init_std=init_std)  # a fresh head if none
    state = source.state_dict()
    for name in ("confidence.proj.weight", "confidence.proj.bias"):
        if name in state:
            state[name] = warm_start_outputs(state[name], source_cfg.confidence_temperatures,
                                             cfg.confidence_temperatures)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(is_confidence_parameter(n) for n in missing), (missing, unexpected)
    for name, p in model.named_parameters():
        p.requires_grad_(is_confidence_parameter(name))
    return model
