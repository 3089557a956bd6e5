"""`angelspec train --drafter draft-lm`: the independent small draft LM baseline.

A shallow `Decoder` with the target's tokenizer and vocabulary, trained with plain next-token CE on
conversations rendered with the target's chat template. Its embedding (tied with the LM head) starts
from the target's, which gives a one-layer model a useful start in a few minutes of CPU time. The
output folder is a HF causal-LM checkpoint plus the target's tokenizer files; its `config.json` carries
an `angelspec` entry (drafter kind, target fingerprint) that the engine checks before decoding.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from angelspec.data.fingerprint import target_weights_fingerprint
from angelspec.data.lm_data import PackedStream, TokenizedDomain, tokenize_split
from angelspec.models.config import DecoderConfig
from angelspec.models.decoder import Decoder
from angelspec.models.hf_io import load_target, read_config, save_target, write_json_atomic
from angelspec.train.config import LMRunConfig, TrainJob, trainer
from angelspec.train.data import data_domains
from angelspec.train.lm import LMRun, heldout_loss, train_causal_lm
from angelspec.train.loop import run_inputs, start_run

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


@dataclass(frozen=True)
class DraftLMTrainConfig(LMRunConfig):
    """The draft LM's shape (the optimisation and the data mix come from `LMRunConfig`)."""

    num_hidden_layers: int = 1
    hidden_size: int | None = None  # None: the target's width (so its embedding can be reused)
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    init_embeddings_from_target: bool = True
    lr: float = 2e-3

    def model_config(self, target: DecoderConfig) -> DecoderConfig:
        return replace(
            target,
            num_hidden_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size or target.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            tie_word_embeddings=True,
        )


def draft_lm_embedded() -> DraftLMTrainConfig:
    """One layer at the embedded target's width: a few minutes on 2 CPU cores."""
    return DraftLMTrainConfig()


def draft_lm_tiny_debug() -> DraftLMTrainConfig:
    return DraftLMTrainConfig(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                              seq_len=64, batch_size=4, steps=4, warmup=1, ckpt_every=2, log_every=1,
                              heldout_docs_per_domain=4)


PRESETS = {"draft_lm_embedded": draft_lm_embedded, "tiny_debug": draft_lm_tiny_debug}


def token_identity(domains: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """The training data of a draft LM as a resume compares it: token count, seq_len and a digest of every
    domain's tokens (`train.checkpoint.INPUT_KEYS`)."""
    import hashlib

    h, tokens = hashlib.sha256(), 0
    for name in sorted(domains):
        dom = domains[name]
        h.update(name.encode() + dom.tokens.tobytes())
        tokens += int(dom.tokens.size)
    return {"rows": tokens, "seq_len": seq_len, "digest": h.hexdigest()[:16]}


def train_draft_lm_job(job: TrainJob, cfg: DraftLMTrainConfig) -> dict[str, Any]:
    """Train the draft LM of `cfg` for `job` (the `Trainer` arguments); `batch_size` is the global batch and
    rank 0 alone writes under data parallelism."""
    from angelspec.data.tokenizer import load_tokenizer
    from angelspec.train.distributed import shutdown, whole_copy

    run = start_run(job, batch_size=cfg.batch_size)
    info, main, target_dir, out_dir = run.info, run.main, run.target_dir, run.out_dir
    run.clear_out_dir()
    target_cfg = read_config(target_dir)
    tok = load_tokenizer(target_dir)
    sep = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train, held, truncated = {}, {}, 0
    for name, (train_path, held_path) in data_domains(job.data).items():
        train[name], t = tokenize_split(tok, train_path, sep, target_cfg.max_position_embeddings)
        truncated += t
        if held_path is not None:
            held[name], _ = tokenize_split(tok, held_path, sep, target_cfg.max_position_embeddings)
    weights = {d: w for d, w in cfg.domain_weights if d in train}
    stream = PackedStream(train, weights, cfg.seq_len, cfg.seed)

    torch.manual_seed(cfg.seed)
    model_cfg = cfg.model_config(target_cfg)
    model = Decoder(model_cfg)
    model.init_weights(generator=torch.Generator().manual_seed(cfg.seed))
    if cfg.init_embeddings_from_target and model_cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError("init_embeddings_from_target needs hidden_size equal to the target's "
                         f"({target_cfg.hidden_size}); set hidden_size=None or init_embeddings_from_target=false")
    # on the host in fp32: the draft LM's master copy of the embedding, and the weights the run records
    target = load_target(target_dir, dtype=torch.float32)
    if cfg.init_embeddings_from_target:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target.embed_tokens.weight)
            model.norm.weight.copy_(target.norm.weight)
    inputs = {**run_inputs("draft-lm", target_weights_fingerprint(target), None),
              "dataset": token_identity(train, cfg.seq_len)}
    del target
    model.to(run.device)  # initialised on the host (the same weights on every device); fp32 master weights
    meta = {"drafter": "draft-lm", "target_fingerprint": target_cfg.fingerprint(),
            "target_weights": inputs["target_weights"], "train_config": json.loads(json.dumps(asdict(cfg)))}

    def save_model(m: Decoder, path: Path) -> None:
        save_target(m, path)
        raw = json.loads((path / "config.json").read_text())
        raw["angelspec"] = meta
        write_json_atomic(path / "config.json", raw)

    run.work.mkdir(parents=True, exist_ok=True)
    lm_run = LMRun(run.ckpt_dir, run.work / "train_log.jsonl", resume=job.resume, progress=job.progress,
                   max_minutes=job.max_minutes, desc="draft-lm", log=run.log, strategy=run.strategy, dist_info=info)
    step = train_causal_lm(model, stream, cfg, lm_run, save_model=save_model, inputs=inputs,
                           autocast_dtype=run.placement.dtype)
    final = whole_copy(model, lambda: Decoder(model_cfg))  # a collective under FSDP2
    if main:
        save_model(final, out_dir)
        for name in TOKENIZER_FILES:
            if (target_dir / name).is_file():
                shutil.copy2(target_dir / name, out_dir / name)
    report = {
        "drafter": "draft-lm", "steps": step, "parameters": model_cfg.num_parameters(),
        "heldout_loss": {d: round(heldout_loss(model, dom, cfg.heldout_docs_per_domain,
                                               target_cfg.max_position_embeddings, False), 4)
                         for d, dom in held.items() if isinstance(dom, TokenizedDomain)},
        "documents_truncated": truncated, "train_seconds": round(time.time() - run.t0, 1),
        "target": str(target_dir), "target_fingerprint": target_cfg.fingerprint(),
    }
    run.finish(report)
    shutdown(info)
    return report


train_draft_lm = trainer(train_draft_lm_job, draft_lm_embedded, "train_draft_lm",
                         "`angelspec train --drafter draft-lm` (`train.config.Trainer`; default preset "
                         "`draft_lm_embedded`).")
