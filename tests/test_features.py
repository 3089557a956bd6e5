"""Hidden-state features (train/features.py): online == offline, resume, corrupt shards, wrong target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from angelspec.data.chat import encode_conversation
from angelspec.data.packing import Doc, PackedBatch, pack_documents
from angelspec.data.tokenizer import load_tokenizer
from angelspec.models import Decoder, load_target
from angelspec.train import features as features_mod
from angelspec.train.features import FeatureBatch, FeatureCacheError, FeatureSpec, OfflineFeatureCache, OnlineFeatures

pytestmark = pytest.mark.usefixtures("one_thread")

TOPK_SPEC = FeatureSpec(layer_ids=(1, 0), with_logits=5, dtype="bfloat16")


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path) -> Decoder:
    return load_target(tiny_target_dir)


@pytest.fixture(scope="module")
def batches(tiny_target_dir: Path) -> list[PackedBatch]:
    """Three packed batches of different shapes (1, 2 and 4 rows; two row lengths)."""
    tok = load_tokenizer(tiny_target_dir)
    docs = []
    for i in range(9):
        msgs = [{"role": "user", "content": f"Tom has {i} apples."},
                {"role": "assistant", "content": "The answer is " + "more " * i}]
        enc = encode_conversation(tok, msgs)
        docs.append(Doc.from_encoded(enc, doc_id=i))
    out = [pack_documents(docs[:2], 96, pad_id=tok.pad_token_id),
           pack_documents(docs[2:5], 96, pad_id=tok.pad_token_id),
           pack_documents(docs[5:], 64, pad_id=tok.pad_token_id)]
    assert [b.num_rows for b in out] == [1, 2, 4]
    return out


def assert_same(a: FeatureBatch, b: FeatureBatch) -> None:
    ta, tb = a.to_tensors(), b.to_tensors()
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert list(a.hidden) == list(b.hidden)


@pytest.mark.parametrize("spec", [TOPK_SPEC, FeatureSpec(layer_ids=(0,), with_logits=True),
                                  FeatureSpec(layer_ids=(1,))], ids=["topk-bf16", "full-logits", "hidden-only"])
def test_online_and_offline_batches_are_identical(target: Decoder, batches: list[PackedBatch], spec: FeatureSpec,
                                                  tmp_path: Path) -> None:
    online = OnlineFeatures(target, spec)
    expected = [online(b) for b in batches]
    first = expected[0]
    R, T = batches[0].input_ids.shape
    h = first.hidden[spec.layer_ids[0]]
    assert h.shape == (R, T, target.config.hidden_size) and h.dtype == spec.torch_dtype and not h.requires_grad
    assert list(first.hidden) == list(spec.layer_ids)
    if spec.topk:
        assert first.teacher_topk_ids.shape == (R, T, spec.topk) and first.logits is None
        assert torch.all(first.teacher_topk_vals <= 0)  # log-probs
    assert (first.logits is not None) == spec.full_logits

    cache = OfflineFeatureCache.build(target, spec, batches, tmp_path / "cache", rows_per_shard=2)
    assert [s["batches"] for s in cache.manifest["shards"]] == [2, 1]  # whole batches: 1+2 rows, then 4
    reader = OfflineFeatureCache.open(tmp_path / "cache", target=target, spec=spec, verify=True)
    got = list(reader)
    assert len(reader) == len(got) == len(expected)
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


def count_forwards(model: Decoder) -> list[int]:
    calls: list[int] = []
    model.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    return calls


def test_resume_after_kill_skips_complete_shards(tiny_target_dir: Path, batches: list[PackedBatch], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    target = load_target(tiny_target_dir)  # own copy: the forward hook must not leak into other tests
    full = OfflineFeatureCache.build(target, TOPK_SPEC, batches, tmp_path / "full", rows_per_shard=1)
    assert len(full.manifest["shards"]) == 3

    root = tmp_path / "killed"
    real_save = features_mod._save_shard

    def dying_save(tensors: dict, path: Path, metadata: dict) -> None:
        if path.name == "shard-00001.safetensors":  # the kill lands mid-write of the second shard
            (path.parent / f".{path.name}.x1y2.tmp").write_bytes(b"\x00" * 100)
            raise KeyboardInterrupt
        real_save(tensors, path, metadata)

    monkeypatch.setattr(features_mod, "_save_shard", dying_save)
    with pytest.raises(KeyboardInterrupt):
        OfflineFeatureCache.build(target, TOPK_SPEC, batches, root, rows_per_shard=1)
    monkeypatch.setattr(features_mod, "_save_shard", real_save)

    with pytest.raises(FeatureCacheError, match="incomplete"):
        OfflineFeatureCache.open(root)
    with pytest.raises(FileExistsError, match="resume=True"):
        OfflineFeatureCache.build(target, TOPK_SPEC, batches, root, rows_per_shard=1)
    with pytest.raises(FeatureCacheError, match="rows_per_shard"):
        OfflineFeatureCache.build(target, TOPK_SPEC, batches, root, rows_per_shard=2, resume=True)
    with pytest.raises(FeatureCacheError, match="input batches of shard-00000"):
        OfflineFeatureCache.build(target, TOPK_SPEC, batches[1:], root, rows_per_shard=1, resume=True)

    calls = count_forwards(target)
    OfflineFeatureCache.build(target, TOPK_SPEC, batches, root, rows_per_shard=1, resume=True)
    assert calls == [batches[1].num_rows, batches[2].num_rows]  # shard 0 was reused, not recomputed
    assert not list(root.glob(".*.tmp"))
    resumed = json.loads((root / "manifest.json").read_text())
    assert resumed["shards"] == full.manifest["shards"]  # same sizes and SHA-256: byte-identical shards
    for a, b in zip(OfflineFeatureCache.open(root, target=target), full, strict=True):
        assert_same(a, b)


def test_corrupt_shard_is_reported_then_rebuilt(target: Decoder, batches: list[PackedBatch], tmp_path: Path) -> None:
    root = tmp_path / "cache"
    OfflineFeatureCache.build(target, TOPK_SPEC, batches, root, rows_per_shard=2)
    shard = root / "shard-00001.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])  # half-written
    with pytest.raises(FeatureCacheError, match=r"shard-00001.safetensors is corrupt or half-written .*resume=True"):
        OfflineFeatureCache.open(root)
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF  # same size, different content: only the hash sees it
    shard.write_bytes(bytes(flipped))
    OfflineFeatureCache.open(root)
    with pytest.raises(FeatureCacheError, match="SHA-256"):
        OfflineFeatureCache.open(root, verify=True)
    notes: list[str] = []
    OfflineFeatureCache.build(target, TOPK_SPEC, batches, root, rows_per_shard=2, resume=True, verify=True,
                              log=notes.append)
    assert shard.read_bytes() == good and notes == ["rebuilding shard-00001.safetensors: shard "
                                                    "shard-00001.safetensors is corrupt (SHA-256 differs from the "
                                                    "manifest)"]
    OfflineFeatureCache.open(root, verify=True)


def test_cache_from_another_target_or_spec_is_refused(tiny_target_dir: Path, target: Decoder,
                                                      batches: list[PackedBatch], tmp_path: Path) -> None:
    root = tmp_path / "cache"
    OfflineFeatureCache.build(target, TOPK_SPEC, batches[:1], root)
    other = load_target(tiny_target_dir)
    with torch.no_grad():
        other.layers[0].mlp.down_proj.weight.mul_(1.5)
    with pytest.raises(FeatureCacheError, match="built from target .* another model"):
        OfflineFeatureCache.open(root, target=other)
    with pytest.raises(FeatureCacheError, match="target_weights"):
        OfflineFeatureCache.build(other, TOPK_SPEC, batches[:1], root, resume=True)
    with pytest.raises(FeatureCacheError, match="spec"):
        OfflineFeatureCache.open(root, target=target, spec=FeatureSpec(layer_ids=(1, 0), with_logits=True,
                                                                       dtype="bfloat16"))
    assert json.loads((root / "manifest.json").read_text())["spec"]["teacher"] == "topk"


def test_spec_validation(target: Decoder) -> None:
    for bad in [dict(layer_ids=()), dict(layer_ids=(0, 0)), dict(layer_ids=[0]), dict(layer_ids=(0,), with_logits=0),
                dict(layer_ids=(0,), dtype="int8")]:
        with pytest.raises(ValueError):
            FeatureSpec(**bad)
    with pytest.raises(FeatureCacheError, match="out of range"):
        OnlineFeatures(target, FeatureSpec(layer_ids=(2,)))
    assert FeatureSpec.from_json(FeatureSpec((0,), 1).to_json()) == FeatureSpec((0,), 1)
    assert FeatureSpec.from_json(FeatureSpec((0,), True).to_json()).full_logits


def test_resume_compares_the_recorded_dataset_not_its_notes(target: Decoder, batches: list[PackedBatch],
                                                            tmp_path: Path) -> None:
    from angelspec.train.features import dataset_identity

    root, spec = tmp_path / "cache", FeatureSpec(layer_ids=(1,))
    dataset = dataset_identity(batches[0], source="a.jsonl")
    OfflineFeatureCache.build(target, spec, batches[:1], root, dataset=dataset)
    resumed = OfflineFeatureCache.build(target, spec, batches[:1], root, resume=True,
                                        dataset={**dataset, "source": "moved/a.jsonl"})
    assert resumed.manifest["dataset"]["source"] == "moved/a.jsonl"
    with pytest.raises(FeatureCacheError, match="cannot resume .*dataset"):
        OfflineFeatureCache.build(target, spec, batches[:1], root, resume=True,
                                  dataset=dataset_identity(batches[1]))
    reader = OfflineFeatureCache.open(root, target=target)
    reader.require([1], dataset)
    with pytest.raises(FeatureCacheError, match=r"lacks target layer\(s\) \[0\]"):
        reader.require([0, 1], dataset)
    assert torch.equal(reader.rows([0]).hidden[1], OnlineFeatures(target, spec)(batches[0]).hidden[1])
