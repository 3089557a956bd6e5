"""Devices and precision: one resolver for --device / --dtype, weights loaded onto the device they are asked for
(proven with the meta device: no GPU is needed), drafters following the target, and every command running with
--dtype bfloat16 (generate, eval, two training steps of every family, export) on the CPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import assert_bad_input, run_cli, write_conversations
from safetensors import safe_open

from angelspec.errors import UsageError
from angelspec.models import load_target, save_target
from angelspec.models.device import (
    DEVICE_ENV,
    Placement,
    autocast,
    resolve_device,
    resolve_dtype,
    resolve_placement,
)

# ----- the resolver -----


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_default_is_the_gpu_in_bf16_where_there_is_one_else_the_cpu_in_fp32(no_gpu, monkeypatch):
    assert resolve_placement() == Placement(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_placement() == Placement(torch.device("cuda", 0), torch.bfloat16)
    assert resolve_placement("cuda:1", "float32") == Placement(torch.device("cuda", 1), torch.float32)
    assert resolve_dtype(None, "cpu") is torch.float32 and resolve_dtype("bf16", "cpu") is torch.bfloat16
    monkeypatch.setenv(DEVICE_ENV, "cpu")  # what the test suite sets on a GPU machine
    assert resolve_placement() == Placement(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(("device", "gpus", "needles"), [
    ("cuda", 0, ["--device cuda", "no CUDA GPU", "--device cpu"]),
    ("cuda:3", 1, ["--device cuda:3", "1 CUDA GPU", "cuda:0..cuda:0"]),
    ("mps", 0, ["--device mps", "MPS", "--device cpu"]),
    ("gpu0", 0, ["'gpu0' is not a device", "cpu, cuda, cuda:N or mps"]),
    ("meta", 0, ["AngelSpec runs on cpu, cuda"]),
])
def test_a_device_that_is_not_there_names_the_fix(no_gpu, monkeypatch, device, gpus, needles):
    if gpus:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(UsageError) as e:
        resolve_device(device)
    for needle in needles:
        assert needle in str(e.value)


def test_an_unknown_dtype_names_the_choices():
    with pytest.raises(UsageError, match="float32 .fp32., bfloat16 .bf16. or float16"):
        resolve_dtype("int8", "cpu")


def test_autocast_runs_matmuls_in_16_bit_and_is_a_no_op_for_fp32():
    a = torch.randn(4, 4)
    with autocast(torch.device("cpu"), torch.bfloat16):
        assert (a @ a).dtype is torch.bfloat16
    with autocast(torch.device("cpu"), torch.float32):
        assert (a @ a).dtype is torch.float32


COMMANDS = {  # the arguments each command needs besides --target and --device
    "generate": ["--prompts", "{p}", "--out", "{o}/out.jsonl"],
    "eval": ["--drafter", "ngram"],
    "bench": ["--config", "AR=none", "--out", "{o}/bench"],
    "profile": ["--drafter", "ngram"],
    "calibrate": ["--drafter", "{o}", "--prompts", "{p}"],
    "train": ["--drafter", "mtp", "--data", "{d}", "--out", "{o}/run"],
    "rollout": ["--prompts", "{p}", "--out", "{o}/roll.jsonl"],
    "features": ["--data", "{d}", "--out", "{o}/cache"],
    "feature-server": ["--data", "{d}", "--stream", "{o}/stream"],
    "eval-server": ["--watch", "{o}", "--once"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_model_command_refuses_a_missing_gpu_in_one_line(capsys, tmp_path, tiny_target_dir, no_gpu, command):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    data = write_conversations(tmp_path / "conv.jsonl", 8, seed=0)
    args = [a.format(p=prompts, o=tmp_path, d=data) for a in COMMANDS[command]]
    code, _, err = run_cli(capsys, command, *args, "--target", tiny_target_dir, "--device", "cuda")
    assert_bad_input(code, err, "--device cuda", "--device cpu")
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "run").exists()


def test_the_demo_refuses_a_missing_gpu_in_one_line(capsys, no_gpu):
    from angelspec.demo import main

    assert main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda" in err[0] and "--device cpu" in err[0]


# ----- loading onto the device -----


def _devices(module: torch.nn.Module) -> set[str]:
    return {t.device.type for t in (*module.parameters(), *module.buffers())}


def test_load_target_places_every_parameter_and_buffer_and_drafters_follow():
    from angelspec.assets import DEFAULT_DRAFT_LM, DEFAULT_DRAFTERS, DEFAULT_TARGET
    from angelspec.decoding.loading import resolve_drafter

    target = load_target(DEFAULT_TARGET, device="meta", dtype=torch.bfloat16)
    assert _devices(target) == {"meta"}
    assert {p.dtype for p in target.parameters()} == {torch.bfloat16}
    for kind in ("dfly", "dspark", "eagle3", "mtp"):
        drafter = resolve_drafter(str(DEFAULT_DRAFTERS / kind), target, DEFAULT_TARGET)
        assert _devices(drafter.model) == {"meta"}, kind
    draft_lm = resolve_drafter(f"draft-lm:{DEFAULT_DRAFT_LM}", target, DEFAULT_TARGET)
    assert _devices(draft_lm.model) == {"meta"}


@pytest.mark.parametrize("tied", [True, False])
def test_streamed_and_fused_weights_equal_the_checkpoint_in_every_dtype_and_shard_layout(tmp_path, tied):
    from dataclasses import replace

    from conftest import tiny_decoder

    from angelspec.models import Decoder
    from angelspec.models.hf_io import ours_to_hf

    model = tiny_decoder(vocab=64, layers=2, dtype=torch.float32)
    if tied:
        torch.manual_seed(1)
        model = Decoder(replace(model.config, tie_word_embeddings=True))
        model.init_weights(std=0.3)
    save_target(model, tmp_path / "one")
    save_target(model, tmp_path / "sharded", max_shard_bytes=4096)  # q/k/v and gate/up land in different shards
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    want = model.state_dict()
    for folder in ("one", "sharded"):
        for dtype in (torch.float32, torch.bfloat16):
            got = load_target(tmp_path / folder, dtype=dtype)
            assert (got.lm_head.weight is got.embed_tokens.weight) == model.config.tie_word_embeddings
            for name, t in got.state_dict().items():
                assert t.dtype is dtype and torch.equal(t, want[name].to(dtype)), (folder, name)
            assert set(ours_to_hf(got.config, got.state_dict())) >= {"model.embed_tokens.weight"}


# ----- training in bf16 -----


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("devices") / "conv.jsonl", 24, seed=3)


def _weights_dtypes(folder: Path) -> set[torch.dtype]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()}  # noqa: SIM118


@pytest.mark.parametrize("kind", ["mtp", "eagle3", "dflash", "dflare", "dfly", "dspark", "draft-lm"])
def test_two_training_steps_of_every_family_run_in_bf16_with_fp32_master_weights(capsys, tmp_path, tiny_target_dir,
                                                                                  conversations, kind):
    from angelspec.assets import DEFAULT_TARGET

    out = tmp_path / kind
    target = DEFAULT_TARGET if kind == "eagle3" else tiny_target_dir  # EAGLE-3 taps three layers: the tiny has 2
    code, _, err = run_cli(capsys, "train", "--drafter", kind, "--target", target, "--data", conversations,
                           "--out", out, "--preset", "tiny_debug", "--dtype", "bfloat16", "--device", "cpu",
                           "--quiet", "steps=2", "ckpt_every=2", "log_every=1", "warmup=1")
    assert code == 0, err
    log = [json.loads(line) for line in (out / "training" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    assert _weights_dtypes(out) == {torch.float32}  # the master weights, not the target's bf16


def test_a_bf16_target_s_run_computes_in_bf16_and_differs_from_fp32(tmp_path, tiny_target_dir, conversations):
    from angelspec.train.mtp import tiny_debug, train_mtp

    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        out = tmp_path / str(dtype)
        train_mtp(tiny_target_dir, conversations, out, config=tiny_debug(), progress=False, log=lambda *_: None,
                  placement=Placement(torch.device("cpu"), dtype))
        losses[dtype] = [json.loads(x)["loss"] for x in (out / "training" / "train_log.jsonl").read_text().splitlines()]
    assert losses[torch.float32] != losses[torch.bfloat16]  # autocast did run the drafter in bf16
    assert losses[torch.float32] == pytest.approx(losses[torch.bfloat16], rel=0.05)


def test_the_feature_cache_of_a_bf16_target_is_stored_in_bf16(tmp_path, tiny_target_dir, conversations):
    from angelspec.train.runs import cache_features

    cache = cache_features(conversations, tmp_path / "cache", target=tiny_target_dir, seq_len=64,
                           placement=resolve_placement("cpu", "bfloat16"), log=lambda *_: None)
    assert cache.spec.dtype == "bfloat16"
    shard = next((tmp_path / "cache").glob("*.safetensors"))
    with safe_open(str(shard), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if "hidden" in k} == {torch.bfloat16}  # noqa: SIM118


def test_row_anchors_are_drawn_on_the_host_and_follow_the_batch(tiny_target_dir, conversations):
    from angelspec.data.tokenizer import load_tokenizer
    from angelspec.models.hf_io import read_config
    from angelspec.train.block import row_anchors
    from angelspec.train.data import pack_conversations, pad_token_id

    rows, _ = pack_conversations(load_tokenizer(tiny_target_dir), conversations, 64, False,
                                 pad_token_id(read_config(tiny_target_dir)), 0)
    batch = rows.take([0, 1])
    a, v = row_anchors(batch, 4, seed=0, step=3, global_rows=[0, 1])
    b, w = row_anchors(batch, 4, seed=0, step=3, global_rows=[0, 1])
    assert torch.equal(a, b) and torch.equal(v, w) and a.device == batch.loss_mask.device


def test_optimizer_state_is_read_onto_the_host(tmp_path, monkeypatch):
    from angelspec.train import checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / checkpoint.OPTIMIZER_STATE)
    seen = {}
    load = torch.load

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return load(*args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "load", spy)
    checkpoint.load_optimizer_state(tmp_path, torch.optim.AdamW(model.parameters()))
    assert seen == {"weights_only": True, "map_location": "cpu"}


def test_the_process_group_backend_can_be_forced(monkeypatch):
    from angelspec.train.distributed import BACKEND_ENV, dist_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert dist_backend() == "nccl"
    monkeypatch.setenv(BACKEND_ENV, "gloo")
    assert dist_backend() == "gloo"
    monkeypatch.setenv(BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match="gloo or nccl"):
        dist_backend()


# ----- decoding and export in bf16 -----


def test_generate_and_eval_run_in_bf16(capsys, tmp_path, tiny_target_dir):
    from angelspec.decoding.settings import DecodeSettings
    from angelspec.eval.runs import evaluate_drafters

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(x, y):"}\n{"prompt": "Tom has 3 apples."}\n')
    code, out, err = run_cli(capsys, "generate", "--prompts", prompts, "--out", tmp_path / "o.jsonl", "--target",
                             tiny_target_dir, "--dtype", "bfloat16", "--drafter", "ngram", "--max-new-tokens", "8",
                             "--quiet")
    assert code == 0, err
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2
    run = evaluate_drafters("ngram", DecodeSettings(max_new_tokens=8), target=tiny_target_dir, prompts=prompts,
                            progress=False, placement=resolve_placement("cpu", "bf16"))
    report = run.reports[0]
    assert report.lossless is not None and report.to_dict()  # measured and checked against AR in bf16


@pytest.mark.parametrize(("flag", "dtype"), [([], torch.bfloat16), (["--dtype", "float32"], torch.float32)])
def test_export_writes_the_chosen_dtype(capsys, tmp_path, tiny_target_dir, flag, dtype):
    from angelspec.models.block.config import BlockDrafterConfig
    from angelspec.models.block.drafter import BlockDrafter
    from angelspec.models.block.io import save_block_drafter

    target = load_target(tiny_target_dir)
    cfg = BlockDrafterConfig.for_target(target.config, mask_token_id=target.config.vocab_size - 1, block_size=4,
                                        num_draft_layers=1, conditioning="dflash", head="none")
    model = BlockDrafter(cfg, target.embed_tokens, target.lm_head)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    src = save_block_drafter(model, tmp_path / "block")
    code, _, err = run_cli(capsys, "export", src, tmp_path / "out", "--target", tiny_target_dir, *flag)
    assert code == 0, err
    assert _weights_dtypes(tmp_path / "out") == {dtype}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == str(dtype)[6:]


# ----- measurement -----


def test_the_cpu_clock_records_each_step_at_once():
    from angelspec.decoding.metrics import DecodeMetrics, PhaseClock

    clock, m = PhaseClock(torch.device("cpu")), DecodeMetrics(num_draft_tokens=2)
    a = clock.mark()
    b = clock.mark()
    clock.step(m, verify=(a, b), commit=(b, b))
    clock.add(m, "prefill", a, b)
    assert m.step_seconds["verify"] == [b - a] and m.step_seconds["commit"] == [0.0]
    assert m.seconds["prefill"] == b - a


def test_the_cuda_clock_bills_event_time_per_phase_and_reads_it_once_at_the_end(monkeypatch):
    """On CUDA a mark is an event on the stream; the seconds between two are the device's (here fake events whose
    clock the test sets), read in one synchronize at the run's end, in step order."""
    from angelspec.decoding.metrics import DecodeMetrics, PhaseClock

    now = {"ms": 0.0}
    syncs = []

    class FakeEvent:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            self.at = now["ms"]

        def elapsed_time(self, end: FakeEvent) -> float:
            assert syncs, "an event was read before the run's synchronize"
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: syncs.append(1))
    clock, m = PhaseClock(torch.device("cuda", 0)), DecodeMetrics(num_draft_tokens=2)
    marks = []
    for ms in (0.0, 5.0, 7.0):  # prefill 5 ms, then one step: verify 2 ms, commit 1 ms
        now["ms"] = ms
        marks.append(clock.mark())
    clock.add(m, "prefill", marks[0], marks[1])
    now["ms"] = 8.0
    clock.step(m, verify=(marks[1], marks[2]), commit=(marks[2], clock.mark()))
    assert m.step_seconds["verify"] == [] and m.seconds["prefill"] == 0.0  # nothing read inside the run
    clock.flush(m)
    assert len(syncs) == 1
    assert m.seconds["prefill"] == pytest.approx(5e-3)
    assert m.step_seconds["verify"] == [pytest.approx(2e-3)] and m.step_seconds["commit"] == [pytest.approx(1e-3)]


def test_a_gpu_run_reports_no_cpu_seconds_or_thread_counts(tiny_target_dir):
    from angelspec.decoding.metrics import DecodeMetrics
    from angelspec.eval.server import _cpu_speedup
    from angelspec.eval.serving.sweep import _machine
    from angelspec.eval.speculative import DomainResult

    cpu = _machine(load_target(tiny_target_dir))
    assert cpu["device"] == "cpu" and cpu["torch_threads"] == torch.get_num_threads()
    gpu_like = _machine(load_target(tiny_target_dir, device="meta", dtype=torch.bfloat16))
    assert gpu_like == {"device": "meta", "dtype": "bfloat16"}
    on_gpu = DecodeMetrics(output_tokens=10, wall_s=1.0)  # the engine leaves cpu_s at 0 off the CPU
    assert _cpu_speedup(DomainResult(prompts=1, ar=on_gpu, spec=on_gpu, identical=None)) is None
    on_cpu = DecodeMetrics(output_tokens=10, wall_s=1.0, cpu_s=2.0)
    assert _cpu_speedup(DomainResult(prompts=1, ar=on_cpu, spec=on_cpu, identical=None)) == 1.0


def test_cache_and_stream_runs_load_only_the_target_s_embedding_norm_and_head(tmp_path, tiny_target_dir,
                                                                              conversations, monkeypatch):
    """From an offline cache the trainer never runs the target's layers: they stay on the meta device (no memory,
    never read), and the cache is still matched against the whole model's fingerprint."""
    from angelspec.data.fingerprint import model_fingerprint
    from angelspec.train import loop
    from angelspec.train.features import target_fingerprint
    from angelspec.train.mtp import tiny_debug, train_mtp
    from angelspec.train.runs import cache_features

    cfg = tiny_debug()
    cache_features(conversations, tmp_path / "cache", target=tiny_target_dir, seq_len=cfg.seq_len,
                   layers=[1], log=lambda *_: None, placement=resolve_placement("cpu"))
    loaded = []
    real = loop.load_target

    def spy(*args, **kwargs):
        loaded.append(real(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(loop, "load_target", spy)
    train_mtp(tiny_target_dir, conversations, tmp_path / "run", config=replace(cfg, features=str(tmp_path / "cache")),
              progress=False, log=lambda *_: None, placement=resolve_placement("cpu"))
    (target,) = loaded
    layers = {p.device.type for n, p in target.named_parameters() if n.startswith("layers.")}
    head = {p.device.type for n, p in target.named_parameters() if not n.startswith("layers.")}
    assert layers == {"meta"} and head == {"cpu"}
    assert target_fingerprint(target, tiny_target_dir) == model_fingerprint(load_target(tiny_target_dir))
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_the_processes_a_run_starts_beside_it_get_its_device_and_dtype(tmp_path, monkeypatch):
    """`train --eval-every` and `--feature-workers` start an eval server and feature servers: they load the target
    on the run's device in its dtype (a feature server in another dtype would serve another fingerprint)."""
    import subprocess

    from angelspec.eval.server import spawn_eval_server
    from angelspec.train.stream import spawn_feature_servers

    started = []

    class FakePopen:
        def __init__(self, cmd, **_):
            started.append(cmd)
            self.pid = 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    spawn_eval_server(tmp_path / "run", device="cpu", dtype="bfloat16")
    spawn_feature_servers(tmp_path / "run", None, tmp_path / "data.jsonl", 2,
                          placement=resolve_placement("cpu", "bfloat16"))
    assert len(started) == 3
    for cmd in started:
        assert cmd[cmd.index("--device") + 1] == "cpu" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
