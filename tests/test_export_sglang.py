"""`angelspec export --format sglang`, checked offline (SGLang has no CPU build here): a DFlash drafter lands in the
layout SGLang's `DFlashDraftModel` loads with every tensor under its name and our values, 0-based tap ids (SGLang
captures "after layer i" from these, like vLLM), and SGLang's launch flags; a draft LM gets STANDALONE flags; what
SGLang cannot load (EAGLE-3 with q/k norm, MTP, DSpark, draft vocabularies, DFly heads) is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_decoder
from test_export import LAYERS, MASK, VOCAB, _assert_same, _block, _dflash_tensors, _eagle3, _init

from angelspec.cli import main
from angelspec.export import ExportCheckError, ExportRefused, export_drafter
from angelspec.export.checks import read_tensors
from angelspec.export.sglang import SGLANG_ARGS, check_sglang_folder
from angelspec.models import save_target
from angelspec.models.block.io import save_block_drafter
from angelspec.models.mtp import MTPConfig, MTPDraftModel
from angelspec.models.mtp_io import save_mtp


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """The 6-layer tiny target of tests/test_export.py, saved as a folder: (path, model)."""
    target = tiny_decoder(vocab=VOCAB, layers=LAYERS, dtype=torch.float32)
    path = tmp_path_factory.mktemp("target")
    save_target(target, path)
    return path, target


def test_dflash_exports_every_tensor_taps_and_flags(target_dir, tmp_path):
    path, target = target_dir
    model = _block(target)
    out = tmp_path / "out"
    result = export_drafter(save_block_drafter(model, tmp_path / "block"), out, target=path, format="sglang")
    c = model.config
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["vocab_size"] == target.config.vocab_size and cfg["hidden_size"] == target.config.hidden_size
    assert cfg["block_size"] == c.block_size == 4 and cfg["num_hidden_layers"] == 2
    # SGLang reads dflash_config.target_layer_ids 0-based ("after layer i", HF style) and adds one itself: ours as is
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": list(c.target_layer_ids)}
    assert cfg["rope_theta"] == c.rope_theta and cfg.get("draft_vocab_size", VOCAB) == VOCAB
    want = _dflash_tensors(model)
    got = read_tensors(out / "model.safetensors")
    _assert_same(got, want)  # names, dtypes and values; no lm_head / d2t (SGLang's DFlash has none)
    assert got["fc.weight"].shape == (c.hidden_size, len(c.target_layer_ids) * c.hidden_size)
    flags = {"--speculative-algorithm": "DFLASH", "--speculative-draft-model-path": str(out.resolve()),
             "--speculative-num-steps": 1, "--speculative-eagle-topk": 1, "--speculative-num-draft-tokens": 4}
    assert json.loads((out / SGLANG_ARGS).read_text()) == result.speculative_config == flags
    assert not (out / "speculative_config.json").exists()  # vLLM's file does not belong in an SGLang folder
    assert "--speculative-algorithm DFLASH" in result.format()


def test_draft_lm_gets_standalone_flags(target_dir, tmp_path):
    path, _ = target_dir
    save_target(tiny_decoder(vocab=VOCAB, layers=1, dtype=torch.float32), tmp_path / "lm")
    result = export_drafter(tmp_path / "lm", tmp_path / "out", target=path, format="sglang")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "lm" / "model.safetensors").read_bytes()
    f = result.speculative_config
    assert f["--speculative-algorithm"] == "STANDALONE" and f["--speculative-eagle-topk"] == 1
    assert f["--speculative-num-draft-tokens"] == f["--speculative-num-steps"] + 1 == 5  # a top-1 chain


def _mtp(target):
    return _init(MTPDraftModel(MTPConfig.for_target(target.config), target.embed_tokens, target.lm_head))


@pytest.mark.parametrize(("build", "save", "words"), [
    (_mtp, save_mtp, "built-in next-n layers.*no loader"),
    (_eagle3, save_mtp, "LlamaForCausalLMEagle3.*q/k norm.*--format vllm"),
    (lambda t: _block(t, head="markov", context_injection="shared"), save_block_drafter, "DSpark.*--format vllm"),
    (lambda t: _block(t, draft_vocab=[1, 2, 3, 4]), save_block_drafter, "draft vocabulary.*no LM head or d2t"),
    (lambda t: _block(t, head="hidden"), save_block_drafter, "head hidden"),
    (lambda t: _block(t, conditioning="dfly", head="markov"), save_block_drafter, "DSpark|dfly"),
    (lambda t: _block(t, bias="trained"), save_block_drafter, r"fc\.bias.*SGLang"),
    (lambda t: _block(t, anchor_fusion=True), save_block_drafter, "fused anchor input.*SGLang.*anchor_fusion=false"),
])
def test_refusals_name_why_in_one_line(target_dir, tmp_path, build, save, words):
    path, target = target_dir
    src = save(build(target), tmp_path / "src")
    with pytest.raises(ExportRefused, match=words) as e:
        export_drafter(src, tmp_path / "out", target=path, format="sglang")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_check_catches_a_broken_sglang_export(target_dir, tmp_path):
    path, target = target_dir
    out = tmp_path / "out"
    export_drafter(save_block_drafter(_block(target), tmp_path / "block"), out, target=path, format="sglang")
    flags = json.loads((out / SGLANG_ARGS).read_text())
    (out / SGLANG_ARGS).write_text(json.dumps({**flags, "--speculative-num-draft-tokens": 8,
                                               "--speculative-num-steps": 1}))
    with pytest.raises(ExportCheckError, match="block_size 4"):
        check_sglang_folder(out, target.config)
    (out / SGLANG_ARGS).write_text(json.dumps(flags))
    tensors = read_tensors(out / "model.safetensors")
    del tensors["layers.1.self_attn.q_norm.weight"]
    from safetensors.torch import save_file
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ExportCheckError, match="q_norm"):
        check_sglang_folder(out, target.config)


def test_cli_export_sglang_prints_flags_and_refuses(target_dir, tmp_path, capsys):
    path, target = target_dir
    src = save_block_drafter(_block(target), tmp_path / "block")
    assert main(["export", "--format", "sglang", str(src), str(tmp_path / "out"), "--target", str(path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("--speculative-algorithm DFLASH --speculative-draft-model-path ")
    mtp = save_mtp(_mtp(target), tmp_path / "mtp")
    assert main(["export", "--format", "sglang", str(mtp), str(tmp_path / "o2"), "--target", str(path)]) == 2
    err = capsys.readouterr().err
    assert "SGLang" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
