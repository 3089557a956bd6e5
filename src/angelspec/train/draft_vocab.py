"""Giving a saved drafter a draft vocabulary (EAGLE-3's reduced draft vocabulary): the `size` target tokens most
frequent in the assistant turns of its training data, plus the end-of-turn tokens. The work behind
`angelspec draft-vocab`.

A drafter module that shares the target's LM head (a block drafter, MTP, EAGLE-3) is rebuilt with the vocabulary
and saved; every draft step then multiplies only those rows of the head. A draft LM keeps its weights and gets
the ids in config.json's "angelspec" entry, read by `DraftLMDrafter.from_pretrained`. Training is unaffected;
drafts the target would pick outside the set are never proposed.

The new folder is built beside the output and swapped in whole (`train.checkpoint.replace_folder`, the files the
output already holds carried over as hard links), so a kill at any moment leaves the drafter as it was or with its
draft vocabulary, never a config of one and the weights of the other. Rewriting the input folder in place needs
`force`: it replaces the drafter the user trained.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from angelspec.assets import resolve_target_dir
from angelspec.data.vocab import coverage, frequent_tokens, token_counts
from angelspec.decoding.loading import load_target_and_tokenizer, other_weights, target_weights_id
from angelspec.errors import UsageError, require_positive
from angelspec.fileio import copy_files, same_path
from angelspec.train.checkpoint import repair_folder, replace_folder

OLD_SUFFIX = ".draft-vocab-old"  # the output's previous folder while the new one is swapped in


@dataclass
class DraftVocabResult:
    """What `apply_draft_vocab` wrote."""

    size: int
    vocab_size: int  # the target's
    data: str
    assistant_tokens: int  # counted in `data`
    coverage: float  # share of those tokens inside the draft vocabulary
    out: Path

    def format(self) -> str:
        return (f"draft vocabulary: the {self.size} most frequent of {self.vocab_size} tokens in {self.data} "
                f"({self.assistant_tokens} assistant tokens) cover {self.coverage:.1%} of them\nwrote {self.out}")


def apply_draft_vocab(drafter: str | Path, data: str | Path, size: int, *, target: str | Path | None = None,
                      out: str | Path | None = None, force: bool = False) -> DraftVocabResult:
    """Count the assistant tokens of the conversations JSONL `data`, keep the `size` most frequent target tokens
    (plus the end-of-turn tokens) and save the drafter folder `drafter` with them to `out` (default: in place).
    Rewriting `drafter` in place, or a model already in another `out`, needs `force`; either is refused before
    anything is written."""
    from angelspec.models.block.drafter import BlockDrafter
    from angelspec.models.block.io import BLOCK_META_KEYS, load_block_drafter, read_block_config, save_block_drafter
    from angelspec.models.hf_io import read_config_json, write_json_atomic
    from angelspec.models.mtp_io import MTP_FAMILY, MTP_META_KEYS, build_mtp_model, load_mtp, read_mtp_config, save_mtp
    from angelspec.train.data import load_conversations

    require_positive("--size", size)
    src = Path(drafter)
    dst = Path(out) if out is not None else src
    final = dst.resolve()  # a symbolic link to a folder keeps pointing at it; the folder is swapped
    repair_folder(final, Path.is_dir, OLD_SUFFIX)  # a rewrite killed between its renames left it under the twin
    in_place = same_path(src, dst)
    if dst.exists() and not dst.is_dir():
        raise UsageError(f"--out {dst} is a file; give --out a folder")
    if not in_place and (dst / "config.json").exists() and not force:
        raise UsageError(f"--out {dst} already holds a model; pass --force to overwrite it")
    raw = read_config_json(src, "it is neither a block drafter nor a draft LM folder (pass a folder written by "
                                "`angelspec train`, or a HF causal-LM folder)", "drafter folder")
    block = "block_drafter_config" in raw
    family = next((kind for kind in MTP_FAMILY if f"{kind}_config" in raw), None)  # MTP / EAGLE-3
    cfg: Any = None
    meta = raw.get("angelspec") or {}
    if block:
        cfg, meta = read_block_config(src)
    elif family is not None:
        cfg, meta = read_mtp_config(src, family)
    vocab_size = cfg.vocab_size if cfg is not None else raw.get("vocab_size")
    if cfg is None and raw.get("model_type") is None:
        raise UsageError(f"{src} is neither a block drafter, an MTP / EAGLE-3 drafter nor a draft LM folder (no "
                         "config.json with a model_type, block_drafter_config, mtp_config or eagle3_config)")
    if size > vocab_size:
        raise UsageError(f"--size {size} exceeds the target vocabulary of {vocab_size} tokens")
    if in_place and not force:
        raise UsageError(f"draft-vocab would rewrite the drafter folder {src} in place; pass --out DIR to write the "
                         "drafter with its draft vocabulary there, or --force to rewrite it in place")
    target_dir = resolve_target_dir(target)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    problem = other_weights(meta.get("target_weights") if isinstance(meta, dict) else None,
                            lambda: target_weights_id(target_dir, model))
    if problem is not None:
        raise UsageError(f"--drafter {src} was trained for a target with {problem}; pass --target with the "
                         "drafter's own target")
    docs, stats = load_conversations(tokenizer, Path(data), model.config.max_position_embeddings)
    counts = token_counts(docs, vocab_size)
    ids = frequent_tokens(counts, size, always=model.config.eos_token_ids)
    record = {"size": size, "data": str(data), "coverage": coverage(counts, ids)}
    if cfg is not None:  # a drafter module sharing the target's LM head: rebuild it with the vocabulary
        if block:
            old, build, save, derived = (load_block_drafter(src, model), BlockDrafter, save_block_drafter,
                                         BLOCK_META_KEYS)
        else:
            old, build, save, derived = load_mtp(src, model, kind=family), build_mtp_model, save_mtp, MTP_META_KEYS
        new = build(replace(cfg, draft_vocab_size=size), model.embed_tokens, model.lm_head)
        new.load_state_dict({k: v for k, v in old.state_dict().items() if k != "draft_vocab"}, strict=False)
        new.set_draft_vocab(ids)
        extra = {k: v for k, v in meta.items() if k not in derived}  # the save writes those from the config

        def write_files(folder: Path) -> None:
            save(new, folder, {**extra, "draft_vocab": record})
    else:  # a draft LM: the ids go into config.json's "angelspec" entry, read by DraftLMDrafter.from_pretrained
        def write_files(folder: Path) -> None:
            if not in_place:
                copy_files(src, folder)
            write_json_atomic(folder / "config.json", {**raw, "angelspec": {**meta, "draft_vocab": ids.tolist(),
                                                                            "draft_vocab_info": record}})

    def write(folder: Path) -> None:
        if dst.is_dir():  # what the output holds stays (as before), apart from the files written next
            copy_files(dst, folder, link=True)
        write_files(folder)

    replace_folder(final, write, complete=Path.is_dir, old_suffix=OLD_SUFFIX)  # the twin is always a whole folder
    return DraftVocabResult(size=size, vocab_size=vocab_size, data=str(data),
                            assistant_tokens=stats["assistant_tokens"], coverage=record["coverage"], out=dst)
