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
    tensors[key].view(-1)[3] = float("nan")  # damaged in place: the size (all the manifest checks) stays the same
    size = shard.stat().st_size
    save_file(tensors, shard, metadata=metadata)
    assert shard.stat().st_size == size
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
