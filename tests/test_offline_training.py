"""Training from the offline feature cache (`angelspec features`, config `features=DIR`) equals online training.

The tiny 2-layer target, 3 steps of `tiny_debug` (seq_len 64): the MTP drafter and the DFly block drafter trained
with the target's forward inside the step and from a cache of all its layers log the same losses and end with the
same weights; a cache made for another target, another dataset or seq_len, or without a needed layer is refused
with a message that names the problem and the command that makes a matching cache.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import QUIET, synthetic_sentences
from safetensors.torch import load_file

from angelspec.train.features import FeatureCacheError, OfflineFeatureCache

pytestmark = pytest.mark.usefixtures("one_thread")


def _conversations(path: Path, seed: int) -> Path:
    lines = list(synthetic_sentences(40, seed=seed))
    pairs = zip(lines[::2], lines[1::2], strict=True)
    turns = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in pairs]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in turns))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _conversations(tmp_path_factory.mktemp("offline_data") / "conv.jsonl", seed=11)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, data: Path) -> Path:
    """Both layers of the tiny target on `data` at seq_len 64, made by the CLI command."""
    from angelspec.cli import main

    out = tmp_path_factory.mktemp("offline_cache") / "features"
    assert main(["features", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(out),
                 "--layers", "0", "--seq-len", "64", "--rows-per-shard", "3"]) == 0
    return out


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "training" / "train_log.jsonl").read_text().splitlines()]


def _assert_same_run(a: Path, b: Path, steps: int) -> None:
    """Same logged loss every step (within 1e-6) and bit-identical final weights."""
    la, lb = _losses(a), _losses(b)
    assert len(la) == len(lb) == steps
    assert lb == pytest.approx(la, abs=1e-6)
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_cache_holds_every_packed_row_once(cache: Path, tiny_target_dir: Path) -> None:
    from angelspec.models import load_target

    reader = OfflineFeatureCache.open(cache, target=load_target(tiny_target_dir), verify=True)
    assert reader.spec.layer_ids == (0, 1) and reader.spec.with_logits is False  # the last layer is always kept
    assert reader.manifest["dataset"]["seq_len"] == 64 and len(reader) == reader.num_rows > 3
    rows = reader.rows([2, 0], layer_ids=[1])
    assert rows.input_ids.shape == (2, 64) and list(rows.hidden) == [1] and rows.hidden[1].shape == (2, 64, 32)


def test_mtp_trains_the_same_from_the_cache(tmp_path: Path, tiny_target_dir: Path, data: Path, cache: Path) -> None:
    from angelspec.train.mtp import tiny_debug, train_mtp

    cfg = tiny_debug()
    online = train_mtp(tiny_target_dir, data, tmp_path / "online", config=cfg, **QUIET)
    offline = train_mtp(tiny_target_dir, data, tmp_path / "offline", config=replace(cfg, features=str(cache)),
                        **QUIET)
    assert online["features"] == "online" and offline["features"] == str(cache)
    _assert_same_run(tmp_path / "online", tmp_path / "offline", cfg.steps)


def test_block_drafter_trains_the_same_from_the_cache(tmp_path: Path, tiny_target_dir: Path, data: Path,
                                                     cache: Path) -> None:
    from angelspec.train.block import tiny_debug, train_dfly

    cfg = tiny_debug()
    train_dfly(tiny_target_dir, data, tmp_path / "online", config=cfg, **QUIET)
    train_dfly(tiny_target_dir, data, tmp_path / "offline", config=replace(cfg, features=str(cache)), **QUIET)
    _assert_same_run(tmp_path / "online", tmp_path / "offline", cfg.steps)


def test_a_cache_that_does_not_fit_the_run_is_refused(tmp_path: Path, tiny_target_dir: Path, data: Path,
                                                      cache: Path) -> None:
    from angelspec.models import load_target, save_target
    from angelspec.train.features import build_feature_cache
    from angelspec.train.mtp import tiny_debug, train_mtp

    def refused(match: str, target: Path = tiny_target_dir, conv: Path = data, **changes: object) -> str:
        cfg = replace(tiny_debug(), features=str(changes.pop("features", cache)), **changes)
        with pytest.raises(FeatureCacheError, match=match) as e:
            train_mtp(target, conv, tmp_path / "out", config=cfg, **QUIET)
        assert f"Make a matching cache with: angelspec features --target {target} --data {conv}" in str(e.value)
        return str(e.value)

    msg = refused("made with seq_len=64, but this run packs rows of seq_len=48", seq_len=48)
    assert "--seq-len 48 --force" in msg
    refused("another dataset or packing", conv=_conversations(tmp_path / "other.jsonl", seed=12))
    refused("enable_thinking", enable_thinking=True)

    last_only = tmp_path / "last_only"  # layer 1 only: MTP on tap 0 needs layer 0 too
    build_feature_cache(tiny_target_dir, data, last_only, seq_len=64, log=lambda *_: None)
    assert "--layers 0,1 --seq-len 64 --force" in refused(r"lacks target layer\(s\) \[0\] that this drafter needs "
                                                          r"\(it holds layers \[1\]\)", features=last_only,
                                                          target_layer_id=0)

    other = tmp_path / "other_target"  # same architecture and tokenizer, other weights
    shutil.copytree(tiny_target_dir, other)
    model = load_target(other)
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(1.5)
    save_target(model, other)
    refused("built from target .* another model", target=other)
    assert not (tmp_path / "out" / "config.json").exists()


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                                 data: Path, cache: Path) -> None:
    from angelspec.cli import main

    common = ["--target", str(tiny_target_dir), "--data", str(data)]
    for argv, needle in [
        (["train", "--drafter", "mtp", *common, "--out", str(tmp_path / "o"), "--preset", "tiny_debug", "--quiet",
          "seq_len=48", f"features={cache}"], "--seq-len 48 --force"),
        (["features", *common, "--out", str(tmp_path / "f"), "--layers", "0,x"], "--layers must be"),
        (["features", *common, "--out", str(tmp_path / "f"), "--layers", "7"], "out of range"),
        (["features", *common, "--out", str(cache), "--seq-len", "64"], "--resume`) to continue it"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
