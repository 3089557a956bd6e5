"""The conversation data every trainer reads: the `--data` layout, tokenised conversations with the assistant loss
mask, and their document-aware packing into rows (report §6.3) served per step.

`data_domains` resolves `--data` (a JSONL file of conversations, or a corpus folder of `<domain>/train.jsonl` [+
`heldout.jsonl`]). The drafter trainers (MTP family, block drafters) and `angelspec features` read it through
`packed_conversations`: chat-template rendering with the assistant mask (`load_conversations`), first-fit
decreasing packing, and `PackedRows`, whose batch at step s is a pure function of (seed, step), so a resumed run
replays the same batches and a feature cache made once serves every run on the same rows.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from angelspec.data.chat import encode_conversation
from angelspec.data.lm_data import read_jsonl
from angelspec.data.packing import Doc, PackedBatch, pack_documents, packing_report
from angelspec.models.config import DecoderConfig
from angelspec.train.config import DrafterRunConfig
from angelspec.train.distributed import DistInfo, shard_rows

CONVERSATION_FORMAT = ('one JSON object a line, {"messages": [{"role": "user", "content": ...}, {"role": "assistant", '
                       '"content": ...}, ...]} with assistant turns')
MAKE_CONVERSATIONS = "make one from prompts with: angelspec rollout --prompts FILE --out FILE"


class DataError(ValueError):
    """A --data file or folder that no trainer can read; the message names the file, the format and the command
    that makes one."""


def check_conversations(data: Path) -> int:
    """Check, before any target is loaded, that every `--data` file holds conversations (`CONVERSATION_FORMAT`) and
    that at least one has a non-empty assistant turn to train on; -> the number of conversations. DataError names
    the first bad line."""
    total = with_assistant = 0
    for train_path, _ in data_domains(Path(data)).values():
        try:
            # JSONL lines end at "\n" only: str.splitlines() would also split inside a JSON string at U+2028 /
            # U+2029 / U+0085, which json.dumps(..., ensure_ascii=False) writes unescaped (real rollouts have them).
            lines = train_path.read_text(encoding="utf-8").split("\n")
        except UnicodeDecodeError:
            raise DataError(f"{train_path} is not a UTF-8 text file; --data needs {CONVERSATION_FORMAT}; "
                            f"{MAKE_CONVERSATIONS}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise DataError(f"{train_path}:{n}: not valid JSON ({e}); --data needs {CONVERSATION_FORMAT}; "
                                f"{MAKE_CONVERSATIONS}") from None
            messages = rec.get("messages") if isinstance(rec, dict) else None
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                keys = f" (it has {', '.join(map(repr, rec))})" if isinstance(rec, dict) else ""
                raise DataError(f"{train_path}:{n}: not a conversation{keys}; --data needs {CONVERSATION_FORMAT}; "
                                f"{MAKE_CONVERSATIONS}")
            total += 1
            with_assistant += any(m.get("role") == "assistant" and m.get("content") for m in messages)
    if not total:
        raise DataError(f"--data {data} holds no conversations; it needs {CONVERSATION_FORMAT}; {MAKE_CONVERSATIONS}")
    if not with_assistant:
        raise DataError(f"--data {data}: none of its {total} conversations has an assistant turn to train on (a "
                        f"prompt file?); it needs {CONVERSATION_FORMAT}; {MAKE_CONVERSATIONS}")
    return total


def data_domains(data: Path) -> dict[str, tuple[Path, Path | None]]:
    """A corpus folder (<domain>/train.jsonl [+ heldout.jsonl]) or a single JSONL file of conversations."""
    if data.is_file():
        return {"data": (data, None)}
    if data.is_dir():
        found = {d.name: (d / "train.jsonl", d / "heldout.jsonl" if (d / "heldout.jsonl").is_file() else None)
                 for d in sorted(data.iterdir()) if (d / "train.jsonl").is_file()}
        if found:
            return found
    raise FileNotFoundError(f"--data {data}: expected a JSONL file of conversations or a corpus folder with "
                            "<domain>/train.jsonl files")


def load_conversations(tokenizer: Any, data: Path, seq_len: int, enable_thinking: bool = False
                       ) -> tuple[list[Doc], dict[str, int]]:
    """Tokenise every conversation with the chat template + assistant loss mask, cut to `seq_len` tokens.

    Returns the documents (in file order) and counts; raises ValueError when no assistant token is left."""
    docs: list[Doc] = []
    stats = {"conversations": 0, "skipped_no_assistant": 0, "truncated": 0, "assistant_tokens": 0}
    for name, (train_path, _) in data_domains(Path(data)).items():
        for i, rec in enumerate(read_jsonl(train_path)):
            stats["conversations"] += 1
            messages = rec.get("messages") if isinstance(rec, dict) else None
            if not isinstance(messages, list):
                raise DataError(f"{train_path} record {i}: expected {{\"messages\": [...]}}; {MAKE_CONVERSATIONS}")
            if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
                stats["skipped_no_assistant"] += 1
                continue
            enc = encode_conversation(tokenizer, messages, enable_thinking=enable_thinking, max_length=seq_len)
            stats["truncated"] += enc.num_truncated > 0
            # Only tokens that some depth can predict count: x_{i+2} needs i >= 0, so not the first two.
            trained = int(sum(enc.loss_mask[2:]))
            stats["assistant_tokens"] += trained
            if trained:
                docs.append(Doc.from_encoded(enc, doc_id=f"{name}:{i}"))
    if not docs:
        raise DataError(f"{data}: no assistant tokens to train on ({stats['conversations']} conversations, "
                        f"{stats['skipped_no_assistant']} without an assistant message); MTP training needs "
                        f"conversations with non-empty assistant turns; {MAKE_CONVERSATIONS}")
    return docs, stats


class PackedRows:
    """All documents packed once (first-fit decreasing); step s reads rows s·B .. s·B+B-1 of a per-epoch
    shuffle keyed by (seed, epoch): a pure function of (seed, step), so resuming replays the same batches."""

    def __init__(self, docs: list[Doc], seq_len: int, pad_id: int, seed: int) -> None:
        self.packed = pack_documents(docs, seq_len, pad_id=pad_id)
        self.seed = seed
        self._perm: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.packed.num_rows))
        return self._perm[1]

    def rows(self, step: int, batch_size: int) -> list[int]:
        """The packed-row indices of global batch `step`."""
        out = []
        for g in range(step * batch_size, (step + 1) * batch_size):
            epoch, r = divmod(g, self.packed.num_rows)
            out.append(int(self._permutation(epoch)[r]))
        return out

    def local_rows(self, step: int, batch_size: int, dist_info: DistInfo | None = None) -> list[int]:
        """The row indices of global batch `step`, or of this rank's slice of it when `dist_info` is given."""
        idx = self.rows(step, batch_size)
        return shard_rows(idx, dist_info) if dist_info is not None and dist_info.enabled else idx

    def batch(self, step: int, batch_size: int, dist_info: DistInfo | None = None) -> PackedBatch:
        """Global batch `step`, or this rank's slice of it when `dist_info` is given."""
        return self.take(self.local_rows(step, batch_size, dist_info))

    def take(self, idx: list[int]) -> PackedBatch:
        """Packed rows `idx` as one batch [len(idx), seq_len]."""
        p = self.packed
        t = torch.tensor(idx)
        return PackedBatch(input_ids=p.input_ids[t], labels=p.labels[t], loss_mask=p.loss_mask[t],
                           document_ids=p.document_ids[t], positions=p.positions[t],
                           row_docs=tuple(p.row_docs[i] for i in idx),
                           num_tokens=int((p.document_ids[t] >= 0).sum()), num_truncated=0, truncated_tokens=0)


def pad_token_id(cfg: DecoderConfig) -> int:
    """The id that fills packed rows: the target's pad token, else its first EOS token, else 0."""
    return cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_token_ids or (0,))[0]


def pack_conversations(tokenizer: Any, data: Path, seq_len: int, enable_thinking: bool, pad_id: int, seed: int
                       ) -> tuple[PackedRows, dict[str, int]]:
    """`data`'s conversations (`load_conversations`) packed into rows of `seq_len` tokens, served in the order of
    `seed`, and their counts: the rows a drafter trainer reads, rebuilt the same by whoever computes its features."""
    docs, stats = load_conversations(tokenizer, data, seq_len, enable_thinking)
    return PackedRows(docs, seq_len, pad_id, seed), stats


def packed_conversations(tokenizer: Any, data: Path, cfg: DrafterRunConfig, pad_id: int, log: Any
                         ) -> tuple[PackedRows, dict[str, int]]:
    """`data`'s conversations packed as the run's `cfg` says (seq_len, enable_thinking, seed), and their counts;
    logs the packing report."""
    rows, stats = pack_conversations(tokenizer, data, cfg.seq_len, cfg.enable_thinking, pad_id, cfg.seed)
    log(packing_report(rows.packed).format())
    return rows, stats


def packed_digest(batches: list[PackedBatch]) -> str:
    """Digest of packed batches' tokens (ids, positions, document ids, loss mask, so also the chat template,
    thinking mode and pad token that made them), to tell two datasets or packings apart."""
    h = hashlib.sha256()
    for b in batches:
        for t in (b.input_ids, b.positions, b.document_ids, b.loss_mask):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def dataset_identity(packed: PackedBatch, **extra: Any) -> dict[str, Any]:
    """What a set of features was made from: row count, seq_len and a digest of the packed tokens
    (`packed_digest`), plus `extra` notes (e.g. `source`) that are shown in messages but not compared."""
    return {"rows": packed.num_rows, "seq_len": packed.seq_len, "digest": packed_digest([packed]), **extra}
