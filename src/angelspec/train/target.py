"""`angelspec target build`: assemble the offline corpus, train the tokenizer, and train the small
Qwen3-architecture target that ships with AngelSpec as the default `--target`.

The run is resumable (atomic checkpoints every `ckpt_every` steps; the data order is a pure
function of (seed, step), so a resumed run sees exactly the batches it would have seen) and ends by
writing a HF-layout folder that `AutoModelForCausalLM` / `AutoTokenizer` load directly.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from angelspec.data.lm_data import PackedStream, TokenizedDomain, read_jsonl, tokenize_split
from angelspec.errors import UsageError, require_range
from angelspec.fileio import require_memory
from angelspec.models.config import DecoderConfig
from angelspec.models.decoder import CacheInputs, Decoder
from angelspec.models.hf_io import load_target, save_target, write_json_atomic
from angelspec.train.checkpoint import refuse_resume_over_model
from angelspec.train.config import LMRunConfig
from angelspec.train.lm import LMRun, heldout_loss, train_causal_lm
from angelspec.train.safety import TRAIN_LOG, empty_folder, refuse_foreign_files, run_guard, unfinished_run

DOMAINS = ("code", "chat", "math", "docs")


@dataclass(frozen=True)
class TargetTrainConfig(LMRunConfig):
    """How the embedded target is trained: its shape and corpus (the optimisation and the data mix come from
    `LMRunConfig`). Presets below; override fields with `replace`."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    context: int = 1024
    corpus_limits: tuple[tuple[str, int], ...] = field(default=())
    seq_len: int = 1024
    steps: int = 1400
    lr: float = 3e-3
    warmup: int = 60
    bf16: bool = True
    heldout_docs_per_domain: int = 200

    def model_config(self, special: dict[str, int]) -> DecoderConfig:
        return DecoderConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.context, rms_norm_eps=1e-6, rope_theta=10000.0, model_type="qwen3",
            qk_norm=True, tie_word_embeddings=True, bos_token_id=None,
            eos_token_id=[special["im_end"], special["endoftext"]], pad_token_id=special["endoftext"],
        )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def check_bounds(self, available: int | None = None) -> None:
        """What the numbers' own ranges (`train.safety.check_bounds`, checked with the overrides) cannot say: a row
        no longer than the model's context, whole key/value head groups, and a model and step whose training fits
        in the memory this machine has free (`available`, default /proc/meminfo's): weights, gradients and AdamW's
        two moments in float32, plus a step's logits."""
        require_range("context=", self.context, 16, 1 << 20)
        require_range("seq_len=", self.seq_len, 2, self.context, " (the model's context=)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UsageError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        n_params = self.model_config({"im_end": 0, "endoftext": 1}).num_parameters()
        need = 16 * n_params + 8 * self.tokens_per_step * self.vocab_size
        require_memory("target build", need, f"{n_params:,} parameters with their AdamW state and a step's logits",
                       available, lower="hidden_size=, intermediate_size=, num_hidden_layers=, batch_size= or seq_len=")


def embedded_target() -> TargetTrainConfig:
    """The shipped default: 6 layers x 256, ~6.8M parameters, 1400 steps x 8k tokens (~1 h on 2 idle CPU cores)."""
    return TargetTrainConfig()


def tiny_debug() -> TargetTrainConfig:
    """Seconds-long end-to-end run for tests: tiny corpus, tiny model."""
    return TargetTrainConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, context=128, seq_len=64, batch_size=4, steps=6, warmup=2,
        ckpt_every=3, log_every=1, bf16=False, heldout_docs_per_domain=5,
        corpus_limits=(("code", 40), ("chat", 40), ("math", 40), ("docs", 20)),
    )


PRESETS = {"embedded_target": embedded_target, "tiny_debug": tiny_debug}


# --------------------------------------------------------------------------------------------------
# Evaluation helpers
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_complete(model: Decoder, prompt_ids: list[int], max_new: int, stop_ids: tuple[int, ...]) -> list[int]:
    """Plain single-row greedy decoding with the static cache (reference quality, not speed)."""
    cache = model.new_cache(1, len(prompt_ids) + max_new + 1)
    logits = model.forward_cached(torch.tensor([prompt_ids]), CacheInputs(cache)).logits[:, -1]
    out: list[int] = []
    for _ in range(max_new):
        tok = int(logits.argmax(-1))
        if tok in stop_ids:
            break
        out.append(tok)
        logits = model.forward_cached(torch.tensor([[tok]]), CacheInputs(cache)).logits[:, -1]
    return out


SAMPLE_PROMPTS = {
    "code": "Write a Python function `is_palindrome(s)` that returns True if the string reads the same backwards.",
    "math": "Tom has 3 boxes with 12 apples each. He gives away 9 apples. How many apples does he have left?",
    "chat": "What are some tips for staying productive when working from home?",
    "docs": "Explain the `with` statement from the Python documentation.",
}


# --------------------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------------------
def build_target(
    out_dir: str | Path,
    *,
    work_dir: str | Path,
    config: TargetTrainConfig | None = None,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    max_minutes: float | None = None,
    corpus_dir: str | Path | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Run (or resume) the whole build and export the model to `out_dir`. Returns the build report.

    `max_minutes` stops training early at a checkpoint (resume later with `resume=True`); the
    export still happens so a usable model exists after any budget. The folders are checked first
    (`check_build_folders`).
    """
    cfg = config or embedded_target()
    cfg.check_bounds()
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    # One build per folder at a time (`train.safety`): the lock of --work-dir (checkpoints, log) and of --out.
    with run_guard(work_dir, flag="--work-dir"), run_guard(out_dir):
        check_build_folders(out_dir, work_dir, resume=resume, force=force)
        return _build(out_dir, work_dir, cfg, resume=resume, progress=progress, max_minutes=max_minutes,
                      corpus_dir=corpus_dir, log=log)


BUILD_FILES = ("corpus", "tokenizer", "checkpoint", TRAIN_LOG)  # what a build writes in --work-dir


def check_build_folders(out_dir: Path, work_dir: Path, *, resume: bool, force: bool) -> None:
    """Refuse, before any work: an --out that holds files without --force or --resume; a --work-dir that holds files
    a build does not write (`BUILD_FILES`) without --force; an unfinished build (a checkpoint or a log) in --work-dir
    without --resume or --force (a fresh build would overwrite it; --force deletes it); a --resume with nothing to
    resume over a finished model (the default --out is the shipped target: never retrain over it by accident)."""
    ckpt_dir = work_dir / "checkpoint"
    if out_dir.is_dir() and any(not p.name.startswith(".") for p in out_dir.iterdir()) and not (force or resume):
        raise FileExistsError(f"{out_dir} already exists and is not empty; pass --force to overwrite it "
                              "or --resume to continue the build")
    if not force:
        refuse_foreign_files(work_dir, BUILD_FILES, flag="--work-dir", what="target build")
    if resume and not force:
        refuse_resume_over_model(out_dir, ckpt_dir)
    where = None if resume else unfinished_run(work_dir)
    if where is not None:
        if not force:
            raise UsageError(f"--work-dir {work_dir} holds an unfinished target build ({where}); pass --resume to "
                             "continue it, or --force to start over (it deletes that build)")
        empty_folder(work_dir)  # all of it (a new build may want another tokenizer) but the lock


def _build(out_dir: Path, work_dir: Path, cfg: TargetTrainConfig, *, resume: bool, progress: bool,
           max_minutes: float | None, corpus_dir: str | Path | None, log: Any) -> dict[str, Any]:
    """`build_target` once its folders are checked and locked."""
    from angelspec.data.corpus import CorpusConfig, build_corpus
    from angelspec.data.tokenizer import load_tokenizer, train_tokenizer

    ckpt_dir = work_dir / "checkpoint"
    work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    # 1. corpus and tokenizer (both idempotent: skipped when already built with the same settings)
    if corpus_dir is None:
        corpus = work_dir / "corpus"
        corpus_config = CorpusConfig(seed=cfg.seed, max_examples=dict(cfg.corpus_limits))
        manifest = build_corpus(corpus, corpus_config, progress=progress)
    else:  # a prepared corpus in the same layout (<domain>/{train,heldout}.jsonl)
        corpus, manifest = Path(corpus_dir), {"corpus_dir": str(corpus_dir)}
    domains = [d for d in DOMAINS if (corpus / d / "train.jsonl").is_file()]
    if not domains:
        raise FileNotFoundError(f"{corpus} holds no <domain>/train.jsonl for any of {', '.join(DOMAINS)}")
    tok_dir = work_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        from angelspec.data.chat import render_chat

        def texts():
            for d in domains:
                for rec in read_jsonl(corpus / d / "train.jsonl"):
                    yield render_chat(rec["messages"], add_generation_prompt=False, enable_thinking=False)

        train_tokenizer(texts(), tok_dir, vocab_size=cfg.vocab_size)
    tok = load_tokenizer(tok_dir)
    special = {"endoftext": tok.pad_token_id, "im_end": tok.eos_token_id}
    log(f"corpus + tokenizer ready in {time.time() - t0:.0f}s")

    # 2. tokenised splits
    train_doms, held_doms, truncated = {}, {}, 0
    for d in domains:
        train_doms[d], t1 = tokenize_split(tok, corpus / d / "train.jsonl", special["endoftext"], cfg.context)
        held_doms[d], t2 = tokenize_split(tok, corpus / d / "heldout.jsonl", special["endoftext"], cfg.context)
        truncated += t1 + t2
    weights = {d: w for d, w in cfg.domain_weights if d in domains}
    stream = PackedStream(train_doms, weights, cfg.seq_len, cfg.seed)
    n_tokens = {d: int(train_doms[d].tokens.size) for d in domains}
    log(f"train tokens per domain: {n_tokens}; {truncated} documents truncated to {cfg.context} tokens; "
        f"{stream.rows_per_epoch} rows of {cfg.seq_len} per epoch")

    # 3. model; 4. train (resumable)
    torch.manual_seed(cfg.seed)
    model = Decoder(cfg.model_config(special))
    model.init_weights(generator=torch.Generator().manual_seed(cfg.seed))
    run = LMRun(ckpt_dir, work_dir / TRAIN_LOG, resume=resume, progress=progress, max_minutes=max_minutes,
                desc="target", log=log)
    step = train_causal_lm(model, stream, cfg, run)

    # 5. evaluate and export
    report = export_target(model, tok_dir, out_dir, held_doms, cfg, step, tok)
    report["build_seconds"] = round(time.time() - t0, 1)
    report["corpus"] = manifest if isinstance(manifest, dict) else {}
    report["documents_truncated"] = truncated
    write_json_atomic(out_dir / "build_info.json", report)
    return report


def export_target(model: Decoder, tok_dir: Path, out_dir: Path, held: dict[str, TokenizedDomain],
                  cfg: TargetTrainConfig, step: int, tok: Any) -> dict[str, Any]:
    """Write the HF folder (bf16 weights keep the repo small) with tokenizer files and a report."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_target(model, out_dir, dtype=torch.bfloat16)
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, out_dir / f.name)
    mc = model.config
    write_json_atomic(out_dir / "generation_config.json", {
        "eos_token_id": list(mc.eos_token_ids), "pad_token_id": mc.pad_token_id, "do_sample": False,
        "max_new_tokens": 256,
    })
    # Evaluate the exported (bf16-rounded) weights, which is what users get.
    shipped = load_target(out_dir)
    losses = {d: round(heldout_loss(shipped, dom, cfg.heldout_docs_per_domain, cfg.context, cfg.bf16), 4)
              for d, dom in held.items()}
    samples = {}
    for d, prompt in SAMPLE_PROMPTS.items():
        if d not in held:
            continue
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      enable_thinking=False)
        out = greedy_complete(shipped, ids, 96, mc.eos_token_ids)
        samples[d] = {"prompt": prompt, "greedy": tok.decode(out, skip_special_tokens=True)}
    return {
        "steps": step, "train_config": asdict(cfg), "parameters": mc.num_parameters(),
        "heldout_loss": losses, "heldout_ppl": {d: round(math.exp(v), 2) for d, v in losses.items()},
        "samples": samples, "command": "angelspec target build --out src/angelspec/assets/target",
    }

