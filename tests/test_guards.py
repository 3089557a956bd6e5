"""Guards against bad files, bad numbers and file-system faults, probed through `main([...])` on edited copies of the
shipped folders (src/angelspec/assets): each is refused before any work with one error line and exit code 2.

- weights and features holding a NaN or an infinity, or tensors of a dtype the model cannot use, are refused when
  they are loaded (they used to give empty completions and exit 0);
- a target whose config.json has no eos_token_id stops where its tokenizer's end tokens say;
- every number a command takes has a bound, and memory-heavy settings are checked against the machine's memory;
- read-only or full outputs, outputs that are inputs, and folders that are not what a command expects are refused,
  with nothing half-written left behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_bad_input, run_cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET = DEFAULT_TARGET
DRAFTERS = DEFAULT_DRAFTERS


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "def add(x, y):"}) + "\n")
    return path


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_tensor(folder: Path, edit, name: str | None = None) -> str:
    """Apply `edit(tensor) -> tensor` to one tensor of folder/model.safetensors (the first float one, or `name`)."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    name = name or next(k for k, v in tensors.items() if v.is_floating_point() and v.dim() == 2)
    tensors[name] = edit(tensors[name].clone())
    save_file(tensors, file, metadata={"format": "pt"})
    return name


def with_nan(t: torch.Tensor) -> torch.Tensor:
    t.view(-1)[7] = float("nan")
    return t


def generate(capsys: pytest.CaptureFixture[str], tmp_path: Path, prompts: Path, *extra: object,
             target: Path = TARGET) -> tuple[int, str, str]:
    return run_cli(capsys, "generate", "--prompts", prompts, "--out", tmp_path / "o.jsonl", "--force",
                   "--target", target, "--max-new-tokens", 2, "--quiet", *extra)


# ----- 1. weights and features: non-finite values and dtypes, refused when loaded -----


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_target_weight_that_is_not_finite_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                       prompts: Path, bad: float) -> None:
    """A NaN target used to give empty completions with finish_reason "stop" and exit 0."""
    target = copy_of(TARGET, tmp_path / "target")

    def poison(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[7] = bad
        return t
    name = edit_tensor(target, poison, "model.layers.3.mlp.down_proj.weight")
    code, _, err = generate(capsys, tmp_path, prompts, target=target)
    assert_bad_input(code, err, str(target / "model.safetensors"), repr(name), "NaN or infinite", "damaged")
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("kind", ["mtp", "dfly", "eagle3"])
def test_a_drafter_weight_that_is_not_finite_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        prompts: Path, kind: str) -> None:
    drafter = copy_of(DRAFTERS / kind, tmp_path / kind)
    name = edit_tensor(drafter, with_nan)
    code, _, err = generate(capsys, tmp_path, prompts, "--drafter", drafter)
    assert_bad_input(code, err, str(drafter / "model.safetensors"), repr(name), "NaN or infinite")


def test_target_weights_of_an_integer_dtype_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        prompts: Path) -> None:
    """Quantised codes read as floats would be garbage weights."""
    target = copy_of(TARGET, tmp_path / "target")
    name = edit_tensor(target, lambda t: t.to(torch.int8), "model.layers.0.self_attn.o_proj.weight")
    code, _, err = generate(capsys, tmp_path, prompts, target=target)
    assert_bad_input(code, err, str(target), repr(name), "is I8, not a float type")


def test_target_weights_that_disagree_with_the_configs_dtype_are_refused(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, prompts: Path) -> None:
    target = copy_of(TARGET, tmp_path / "target")
    name = edit_tensor(target, lambda t: t.to(torch.float16), "model.norm.weight")
    code, _, err = generate(capsys, tmp_path, prompts, target=target)
    assert_bad_input(code, err, str(target), repr(name), "is F16", "torch_dtype bfloat16", "set torch_dtype")


def test_a_drafter_tensor_of_the_wrong_kind_of_dtype_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                prompts: Path) -> None:
    drafter = copy_of(DRAFTERS / "mtp", tmp_path / "mtp")
    name = edit_tensor(drafter, lambda t: t.to(torch.int32))
    code, _, err = generate(capsys, tmp_path, prompts, "--drafter", drafter)
    assert_bad_input(code, err, str(drafter), repr(name), "is I32, not a float type")


def test_a_feature_cache_holding_a_nan_is_refused_when_read(tiny_target_dir: Path, tmp_path: Path) -> None:
    from angelspec.data.packing import Doc, pack_documents
    from angelspec.models import load_target
    from angelspec.train.features import FeatureCacheError, FeatureSpec, OfflineFeatureCache

    target = load_target(tiny_target_dir)
    batch = pack_documents([Doc(input_ids=list(range(5, 40)), loss_mask=[1] * 35, doc_id=0)], 48, pad_id=0)
    spec = FeatureSpec(layer_ids=(1,))
    OfflineFeatureCache.build(target, spec, [batch], tmp_path / "cache", rows_per_shard=2)
    shard = next((tmp_path / "cache").glob("*.safetensors"))
    with safe_open(shard, framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(shard)
    key = next(k for k in tensors if k.endswith("hidden.1"))
    tensors[key].view(-1)[3] = float("nan")  # as a target with a damaged weight would have written it
    save_file(tensors, shard, metadata=metadata)
    from angelspec.data.fingerprint import file_sha256

    manifest_file = tmp_path / "cache" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["shards"][0].update(sha256=file_sha256(shard), bytes=shard.stat().st_size)  # its hash is the one listed
    manifest_file.write_text(json.dumps(manifest))
    cache = OfflineFeatureCache.open(tmp_path / "cache", target=target, spec=spec)
    with pytest.raises(FeatureCacheError, match=r"'hidden.1' holds 1 NaN or infinite value.*build it again"):
        list(cache)
    with pytest.raises(FeatureCacheError, match=r"'hidden.1' holds 1 NaN"):
        cache.rows([0])


# ----- 2. a config.json without eos_token_id -----


def _without(file: Path, *keys: str) -> None:
    raw = json.loads(file.read_text())
    for key in keys:
        raw.pop(key, None)
    file.write_text(json.dumps(raw))


def _completions(capsys: pytest.CaptureFixture[str], tmp_path: Path, target: Path, name: str) -> list[dict]:
    out = tmp_path / f"{name}.jsonl"
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("What is 7 + 8?",)))
    code, _, err = run_cli(capsys, "generate", "--prompts", chat, "--out", out, "--target", target,
                           "--max-new-tokens", 48, "--quiet")
    assert code == 0, err
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_config_without_eos_stops_at_the_tokenizers_end_tokens(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    """Generation used to run on past the end of the reply to --max-new-tokens."""
    expected = _completions(capsys, tmp_path, TARGET, "shipped")
    assert [r["finish_reason"] for r in expected] == ["stop"]
    target = copy_of(TARGET, tmp_path / "target")
    _without(target / "config.json", "eos_token_id")
    assert _completions(capsys, tmp_path, target, "no_eos") == expected  # generation_config.json's end tokens
    _without(target / "generation_config.json", "eos_token_id")
    from angelspec.models import read_config

    assert read_config(target).eos_token_ids == (2,)  # tokenizer_config.json's eos_token, <|im_end|>
    got = _completions(capsys, tmp_path, target, "tokenizer_eos")
    assert [r["finish_reason"] for r in got] == [r["finish_reason"] for r in expected]
    assert [r["completion"] for r in got] == [r["completion"] for r in expected]


def test_a_target_with_no_end_token_anywhere_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        prompts: Path) -> None:
    target = copy_of(TARGET, tmp_path / "target")
    for name in ("config.json", "generation_config.json"):
        _without(target / name, "eos_token_id")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        _without(target / name, "eos_token")
    # Still our tokenizer layout, whose chat format ends a turn with <|im_end|>: generation stops there.
    assert _completions(capsys, tmp_path, target, "layout")[0]["finish_reason"] == "stop"
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a plain HF tokenizer that names no end token
        (target / name).write_text((target / name).read_text().replace("<|im_end|>", "<|end|>"))
    code, _, err = generate(capsys, tmp_path, prompts, target=target)
    assert_bad_input(code, err, str(target), "no eos token", "eos_token_id")


# ----- 3. every number has a bound, checked before work starts -----

HUGE = 10**9


@pytest.fixture
def conversations(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                                     {"role": "assistant", "content": f"It is {2 * i}."}]}) + "\n"
                            for i in range(2)))
    return path


def _bounds_cases(tmp: Path, prompts: Path, data: Path) -> list[tuple[list[object], list[str]]]:
    mtp = DRAFTERS / "mtp"
    gen = ["generate", "--prompts", prompts, "--out", tmp / "o.jsonl", "--quiet"]
    ev = ["eval", "--drafter", "ngram", "--prompts", prompts, "--quiet"]
    bench = ["bench", "--config", "AR=none", "--concurrency", "1", "--out", tmp / "bench", "--quiet"]
    prof = ["profile", "--drafter", "ngram", "--batch-sizes", "1", "--out", tmp / "costs.json"]
    cal = ["calibrate", "--drafter", mtp, "--prompts", prompts, "--quiet"]
    roll = ["rollout", "--prompts", data, "--out", tmp / "r.jsonl", "--quiet"]
    feat = ["features", "--data", data, "--out", tmp / "f"]
    serve = ["feature-server", "--data", data, "--stream", tmp / "s"]
    k64 = "--num-draft-tokens must be at least 1 and at most 64"
    new = "--max-new-tokens must be at least 1 and at most"
    return [
        ([*gen, "--drafter", "ngram", "--num-draft-tokens", HUGE], [k64]),
        ([*gen, "--drafter", f"ngram:{HUGE}"], ["ngram:N must be at least 1 and at most 64"]),
        ([*gen, "--drafter", f"{mtp}+ngram:3:1:{HUGE}"], ["must be at least 1 and at most 64"]),
        ([*gen, "--max-new-tokens", HUGE], [new]),
        ([*gen, "--batch-size", HUGE], ["--batch-size must be at least 1 and at most 4096"]),
        ([*ev, "--batch-size", HUGE], ["--batch-size must be at least 1 and at most 4096"]),
        ([*ev, "--num-draft-tokens", 0], [k64]),
        ([*ev, "--max-new-tokens", 0], [new]),
        ([*bench, "--min-requests", HUGE], ["--min-requests must be at least 1 and at most 1000000"]),
        ([*bench, "--warmup-tokens", HUGE], ["--warmup-tokens must be at least 0 and at most"]),
        ([*bench, "--num-draft-tokens", HUGE], [k64]),
        ([*prof, "--repeats", HUGE], ["--repeats must be at least 1 and at most 10000"]),
        ([*prof[:4], HUGE, *prof[5:]], ["--batch-sizes must be at least 1 and at most 4096"]),
        ([*prof, "--warmup", -1], ["--warmup must be at least 0 and at most 10000"]),
        ([*cal, "--max-new-tokens", HUGE], [new]),
        ([*cal, "--batch-size", HUGE], ["--batch-size must be at least 1 and at most 4096"]),
        ([*roll, "--max-new-tokens", HUGE], [new]),
        ([*roll, "--batch-size", HUGE], ["--batch-size must be at least 1 and at most 4096"]),
        ([*feat, "--seq-len", HUGE], ["--seq-len 1000000000 is longer than the target's context"]),
        ([*feat, "--seq-len", 64, "--rows-per-shard", HUGE], ["--rows-per-shard must be at most"]),
        ([*feat, "--seq-len", 64, "--layers", 9], ["--layers", "0..5"]),
        ([*serve, "--buffer", HUGE], ["--buffer must be at least 1 and at most 1024"]),
        ([*serve, "--idle-timeout", -1], ["--idle-timeout must be at least"]),
        ([*serve, "--workers", 2, "--worker", 5], ["--worker must be in 0..1"]),
        (["eval-server", "--watch", tmp, "--threads", HUGE, "--once"], ["--threads must be at least 1 and at most"]),
        (["eval-server", "--watch", tmp, "--poll", -1, "--once"], ["--poll must be at least 0 and at most 86400"]),
        (["eval-server", "--watch", tmp, "--idle-timeout", -5], ["--idle-timeout must be at least"]),
        (["eval-server", "--watch", tmp, "--wait", -5], ["--wait must be at least 0"]),
        (["eval-server", "--watch", tmp, "--temperatures", "0,nan"], ["--temperatures must be finite"]),
        (["eval-server", "--watch", tmp, "--max-new-tokens", HUGE], [new]),
        (["eval-server", "--watch", tmp, "--num-draft-tokens", HUGE], [k64]),
        (["eval-server", "--watch", tmp, "--trainer-pid", 0, "--once"], ["--trainer-pid must be at least 1"]),
        (["build-drafters", "--work-dir", tmp / "w", "--no-export", "--max-minutes", -1],
         ["--max-minutes must be a number of minutes > 0"]),
        (["decontam", "--train", data, "--eval", prompts, "--out", tmp / "d.jsonl", "--ngram", HUGE],
         ["--ngram) must be at most 1024"]),
        (["prompt-pool", "--out", tmp / "pool.jsonl", "--min-total", HUGE, "--quiet"],
         ["--min-total must be at least 0 and at most 1000000"]),
        (["prompt-pool", "--out", tmp / "pool.jsonl", "--per-domain", '{"code": -1}', "--quiet"],
         ["--per-domain code must be at least 0"]),
        (["target", "build", "--out", tmp / "t", "--work-dir", tmp / "w", f"hidden_size={HUGE}"],
         ["hidden_size=1000000000 is out of range"]),
        (["target", "build", "--out", tmp / "t", "--work-dir", tmp / "w", "grad_clip=-1"],
         ["grad_clip=-1.0 is out of range"]),
        (["target", "build", "--out", tmp / "t", "--work-dir", tmp / "w", "lr=1e30"], ["lr=1e+30 is out of range"]),
        (["target", "build", "--out", tmp / "t", "--work-dir", tmp / "w", "seq_len=4096"],
         ["seq_len= must be at least 2 and at most 1024", "context="]),
    ]


def test_every_number_has_a_bound_checked_before_work(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                      prompts: Path, conversations: Path) -> None:
    """Each of these used to run (10^9 n-gram sizes and drafts grew until the kernel killed the process) or was
    accepted silently; now each is one line naming the flag and its range, and nothing is written."""
    for args, needles in _bounds_cases(tmp_path, prompts, conversations):
        code, _, err = run_cli(capsys, *args)
        assert_bad_input(code, err, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl", "train.jsonl"]


def test_memory_heavy_settings_are_checked_against_free_memory(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                prompts: Path, conversations: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import angelspec.fileio as fileio
    from angelspec.train import runs

    for module in (fileio, runs):  # a machine with 64 MiB free
        monkeypatch.setattr(module, "available_memory_bytes", lambda: 64 * 1024**2)
    code, _, err = run_cli(capsys, "bench", "--config", "AR=none", "--concurrency", "1,64", "--out", tmp_path / "b",
                           "--quiet")
    assert_bad_input(code, err, "--concurrency: the KV cache of 64 row(s) of 1024 tokens", "64.0 MiB of memory free",
                     "lower --concurrency")
    code, _, err = run_cli(capsys, "features", "--data", conversations, "--out", tmp_path / "f", "--seq-len", 1024,
                           "--rows-per-shard", 512)
    assert_bad_input(code, err, "--rows-per-shard 512 x --seq-len 1024", "lower --rows-per-shard")
    code, _, err = run_cli(capsys, "target", "build", "--out", tmp_path / "t", "--work-dir", tmp_path / "w")
    assert_bad_input(code, err, "target build:", "parameters with their AdamW state", "lower hidden_size=")
    assert not (tmp_path / "b").exists() and not (tmp_path / "f").exists() and not (tmp_path / "w").exists()


def test_the_decoding_bounds_as_library_calls() -> None:
    from angelspec.decoding.limits import check_counts, check_fits_target
    from angelspec.errors import UsageError
    from angelspec.models import read_config

    check_counts(max_new_tokens=256, batch_size=8, num_draft_tokens=16, limit=3)
    config = read_config(TARGET)
    check_fits_target(config, rows=8, num_draft_tokens=16, available=1024**3)
    with pytest.raises(UsageError, match=r"--batch-size: the KV cache of 200 row\(s\)"):
        check_fits_target(config, rows=200, available=1024**3)  # 200 rows x 1026 tokens x 6 KiB: 1.2 GiB
    with pytest.raises(UsageError, match=r"^num_draft_tokens must be at least 1 and at most 64, got nan"):
        check_counts(num_draft_tokens=float("nan"))


def test_the_kv_cache_is_checked_against_the_memory_of_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA device the KV cache is compared with the GPU's free memory (torch.cuda.mem_get_info), on the CPU
    with the host's; another accelerator, whose free memory torch does not report, is not checked."""
    import angelspec.fileio as fileio
    from angelspec.decoding.limits import check_fits_target, free_memory
    from angelspec.errors import UsageError
    from angelspec.models import read_config

    config = read_config(TARGET)
    asked = []

    def mem_get_info(device=None):
        asked.append(device)
        return 64 * 1024**2, 80 * 1024**3

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(fileio, "available_memory_bytes", lambda: 1024**4)  # a host with 1 TiB free
    cuda = torch.device("cuda", 1)
    assert free_memory(cuda) == (64 * 1024**2, "the GPU cuda:1") and asked == [cuda]
    with pytest.raises(UsageError, match=r"--batch-size: the KV cache of 64 row\(s\).*but the GPU cuda:1 has 64.0 MiB "
                       r"of memory free; lower --batch-size"):
        check_fits_target(config, rows=64, device=cuda)
    check_fits_target(config, rows=64, device=torch.device("cpu"))  # the host has room
    check_fits_target(config, rows=6, device=cuda)  # 36 MiB of cache fit in 90% of 64 MiB; with the weights a bench
    with pytest.raises(UsageError, match=r"the KV cache of 6 row\(s\) of 1024 tokens and the target's weights"):
        check_fits_target(config, rows=6, device=cuda, with_weights=True)  # loads after the check (26 MiB), not
    check_fits_target(config, rows=64)
    check_fits_target(config, rows=64, device=torch.device("meta"))  # no free memory to read: not checked
    monkeypatch.setattr(fileio, "available_memory_bytes", lambda: 64 * 1024**2)
    with pytest.raises(UsageError, match="but this machine has 64.0 MiB of memory free"):
        check_fits_target(config, rows=64, device=torch.device("cpu"))


def test_one_byte_formatter_for_both_unit_names() -> None:
    from angelspec.fileio import human_bytes
    from angelspec.models import hf_io

    assert human_bytes(1536) == "1.5 KiB" and human_bytes(3 * 1024**3) == "3.0 GiB" and human_bytes(12) == "12 B"
    assert human_bytes(1536, units="KB") == "1.5 KB" and human_bytes(5 * 1024**5, units="KB") == "5120.0 TB"
    assert not hasattr(hf_io, "_human")  # the checkpoint checks format through it


# ----- 4. faults of the file system, outputs that are inputs, folders that are not what a command expects -----


def _disk_full_after(nbytes: int):
    """A stand-in for a writer that fills the disk: writes `nbytes` of the file, then raises ENOSPC."""
    import errno
    import os

    def write(tensors, path, metadata=None) -> None:
        Path(path).write_bytes(b"\0" * nbytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return write


def _read_only(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """`folder` reads as not writable (tests run as root, for whom chmod does not stop a write)."""
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if Path(p) == folder and mode & os.W_OK
                        else real(p, mode, *a, **k))


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_export_to_a_full_disk_leaves_the_previous_export_untouched(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from angelspec.models import hf_io

    out = tmp_path / "export"
    code, _, err = run_cli(capsys, "export", DRAFTERS / "eagle3", out)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(hf_io, "save_file", _disk_full_after(1000))
    code, _, err = run_cli(capsys, "export", DRAFTERS / "eagle3", out, "--force")
    assert_bad_input(code, err, "No space left on device", "the disk is full", "nothing half-written")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # --force used to empty it first
    assert _leftovers(tmp_path) == []
    code, _, err = run_cli(capsys, "export", DRAFTERS / "eagle3", tmp_path / "fresh")
    assert_bad_input(code, err, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_export_refuses_a_read_only_folder_and_its_own_inputs(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    target = copy_of(TARGET, tmp_path / "target")
    code, _, err = run_cli(capsys, "export", DRAFTERS / "eagle3", target, "--target", target, "--force")
    assert_bad_input(code, err, "is the target folder --target itself", "destroy the input")
    code, _, err = run_cli(capsys, "export", DRAFTERS / "eagle3", tmp_path, "--target", target, "--force")
    assert_bad_input(code, err, f"contains the target folder --target {target}")
    assert (target / "model.safetensors").is_file()
    _read_only(monkeypatch, tmp_path / "ro")
    (tmp_path / "ro").mkdir()
    code, _, err = run_cli(capsys, "export", DRAFTERS / "eagle3", tmp_path / "ro" / "out")
    assert_bad_input(code, err, "OUT_DIR", "is not writable")


def test_features_on_a_full_disk_is_one_line_and_leaves_no_half_written_shard(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, conversations: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from angelspec.models import hf_io

    monkeypatch.setattr(hf_io, "save_file", _disk_full_after(500))
    out = tmp_path / "f"
    code, _, err = run_cli(capsys, "features", "--data", conversations, "--out", out, "--seq-len", 64)
    assert_bad_input(code, err, "No space left on device", "the disk is full")
    assert not list(out.glob("*.safetensors")) and not list(out.glob(".*"))
    code, _, err = run_cli(capsys, "features", "--data", conversations, "--out", conversations, "--seq-len", 64)
    assert_bad_input(code, err, "is the same file as the input --data")
    _read_only(monkeypatch, tmp_path / "ro")
    (tmp_path / "ro").mkdir()
    code, _, err = run_cli(capsys, "features", "--data", conversations, "--out", tmp_path / "ro" / "f", "--seq-len",
                           64)
    assert_bad_input(code, err, "--out", "is not writable")


def test_rollout_on_a_full_disk_is_one_line_and_resumes_to_the_same_file(capsys: pytest.CaptureFixture[str],
                                                                         tmp_path: Path, conversations: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from angelspec.train import rollout as rollout_mod

    args = ["rollout", "--prompts", conversations, "--max-new-tokens", 4, "--batch-size", 1, "--quiet"]
    code, _, err = run_cli(capsys, *args, "--out", tmp_path / "clean.jsonl")
    assert code == 0, err
    real = rollout_mod._append_chunk

    def full(out: Path, lines: list[str]) -> int:
        with open(out, "a", encoding="utf-8") as f:
            f.write(lines[0][:10])  # a torn line, as a full disk leaves it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out))
    monkeypatch.setattr(rollout_mod, "_append_chunk", full)
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, *args, "--out", out)
    assert_bad_input(code, err, str(out), "No space left on device", "the disk is full")
    monkeypatch.setattr(rollout_mod, "_append_chunk", real)
    code, _, err = run_cli(capsys, *args, "--out", out, "--resume")
    assert code == 0, err
    assert out.read_bytes() == (tmp_path / "clean.jsonl").read_bytes()


def test_calibrate_and_profile_refuse_unwritable_outputs_before_any_work(capsys: pytest.CaptureFixture[str],
                                                                         tmp_path: Path, prompts: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    drafter = copy_of(DRAFTERS / "mtp", tmp_path / "mtp")
    _read_only(monkeypatch, drafter)
    code, _, err = run_cli(capsys, "calibrate", "--drafter", drafter, "--prompts", prompts, "--quiet")
    assert_bad_input(code, err, "--drafter", str(drafter), "is not writable")
    _read_only(monkeypatch, tmp_path / "ro")
    (tmp_path / "ro").mkdir()
    code, _, err = run_cli(capsys, "profile", "--drafter", "ngram", "--batch-sizes", "1", "--out",
                           tmp_path / "ro" / "costs.json")
    assert_bad_input(code, err, "--out", "is not writable")
    code, _, err = run_cli(capsys, "profile", "--drafter", "ngram", "--batch-sizes", "1", "--out", prompts)
    assert_bad_input(code, err, str(prompts), "is not a cost table", "give --out a new file")  # never overwritten
    assert json.loads(prompts.read_text()) == {"prompt": "def add(x, y):"}


def test_calibrate_on_a_full_disk_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, prompts: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from angelspec.decoding.policies import sts

    drafter = copy_of(DRAFTERS / "mtp", tmp_path / "mtp")
    before = sorted(p.name for p in drafter.iterdir())

    def full(path: Path, obj: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    monkeypatch.setattr(sts, "write_json_atomic", full)
    code, _, err = run_cli(capsys, "calibrate", "--drafter", drafter, "--prompts", prompts, "--max-new-tokens", 8,
                           "--quiet")
    assert_bad_input(code, err, "calibration.json", "No space left on device")
    assert sorted(p.name for p in drafter.iterdir()) == before


def test_eval_server_refuses_a_folder_that_is_not_a_training_run(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    """It used to wait forever and create training/ inside the folder."""
    folder = copy_of(DRAFTERS / "mtp", tmp_path / "finished")  # a drafter folder, not a run
    before = sorted(p.name for p in folder.iterdir())
    code, _, err = run_cli(capsys, "eval-server", "--watch", folder, "--poll", 1)
    assert_bad_input(code, err, str(folder), "is not a training run", "no training/ folder", "--out folder")
    assert sorted(p.name for p in folder.iterdir()) == before


def test_prompt_pool_never_overwrites_a_file_without_force_nor_its_held_out_prompts(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, prompts: Path) -> None:
    """It used to replace --out (and write its report beside it) whatever was there."""
    code, _, err = run_cli(capsys, "prompt-pool", "--out", prompts, "--quiet")
    assert_bad_input(code, err, str(prompts), "already exists", "--force")
    code, _, err = run_cli(capsys, "prompt-pool", "--out", prompts, "--heldout", prompts, "--force", "--quiet")
    assert_bad_input(code, err, "is the same file as the input --heldout")
    assert json.loads(prompts.read_text()) == {"prompt": "def add(x, y):"}


def test_bench_does_not_overwrite_an_earlier_sweep_without_force(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "bench"
    out.mkdir()
    (out / "results.json").write_text("{}")
    code, _, err = run_cli(capsys, "bench", "--config", "AR=none", "--concurrency", "1", "--out", out, "--quiet")
    assert_bad_input(code, err, "already holds a sweep", "--force")
    assert (out / "results.json").read_text() == "{}"
