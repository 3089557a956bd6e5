"""Llama-family targets end to end: a random Llama-shaped target (no q/k norm, untied LM head, llama3 RoPE scaling),
drafters trained for it for two steps, decoded losslessly, exported in vLLM's Llama EAGLE-3 / Qwen3 DFlash layouts
(and the angelspec[vllm] plugin's MTP with a Llama layer, DFly with Qwen3 layers),
read back by `angelspec import` with the same weights and logits, and the refusals that name why."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_bad_input,
    run_cli,
    same_weights,
    synthetic_sentences,
    write_conversations,
    write_domain_prompts,
)

from angelspec.export import ExportRefused, export_drafter
from angelspec.export.checks import check_vllm_folder, read_tensors
from angelspec.export.vllm_import import ImportRefused, import_vllm
from angelspec.models import Decoder, DecoderConfig, load_target, save_target

LAYERS = 6
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 6-layer Llama 3-shaped target with the tiny tokenizer, saved in HF layout."""
    from angelspec.data.tokenizer import load_tokenizer, train_tokenizer

    out = tmp_path_factory.mktemp("llama_target")
    train_tokenizer(synthetic_sentences(400), out, vocab_size=300)
    tok = load_tokenizer(out)
    cfg = DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                        model_type="llama", qk_norm=False, tie_word_embeddings=False, rope_theta=500000.0,
                        rope_scaling=LLAMA3_ROPE, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Decoder(cfg)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_target(model, out)
    return out


@pytest.fixture(scope="module")
def conversations(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("llama_data") / "conv.jsonl", 40, seed=3)


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory, llama_dir, conversations) -> Path:
    from angelspec.train.eagle3 import tiny_debug, train_eagle3

    out = tmp_path_factory.mktemp("llama_eagle3") / "eagle3"
    train_eagle3(llama_dir, conversations, out, config=replace(tiny_debug(), steps=2), progress=False,
                 log=lambda *_: None)
    return out


def test_the_target_reads_back_as_llama(llama_dir):
    target = load_target(llama_dir)
    cfg = target.config
    assert (cfg.model_type, cfg.qk_norm, cfg.tie_word_embeddings, cfg.rope_type) == ("llama", False, False, "llama3")
    assert not any("q_norm" in n or "k_norm" in n for n, _ in target.named_parameters())


def _eagle3_logits(folder: Path, target, taps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    from angelspec.models.mtp_io import load_mtp

    model = load_mtp(folder, target, kind="eagle3").eval()
    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    with torch.no_grad():
        return model.logits(model(taps, tokens, positions))


def test_eagle3_trains_decodes_losslessly_exports_the_llama_class_and_imports_back(tmp_path, llama_dir, eagle3_dir,
                                                                                    capsys):
    raw = json.loads((eagle3_dir / "config.json").read_text())["eagle3_config"]
    assert raw["qk_norm"] is False and raw["model_type"] == "llama"  # the Llama layer vLLM's llama_eagle3.py builds

    prompts = write_domain_prompts(tmp_path / "prompts.jsonl")
    code, out, err = run_cli(capsys, "eval", "--target", llama_dir, "--drafter", eagle3_dir, "--prompts", prompts,
                             "--max-new-tokens", "8", "--quiet")
    assert code == 0 and "lossless: yes (3/3" in out, err

    code, out, err = run_cli(capsys, "export", "--format", "vllm", eagle3_dir, tmp_path / "vllm", "--target",
                             llama_dir, "--dtype", "float32")  # the trained dtype, so the import is bit-identical
    assert code == 0, err
    assert '"method": "eagle3"' in out
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in raw["target_layer_ids"]]
    assert cfg["rope_scaling"] is None and cfg["rope_theta"] == 500000.0  # the drafter's plain RoPE, as ours
    tensors = read_tensors(tmp_path / "vllm" / "model.safetensors")
    # vLLM's Llama EAGLE-3 layer: midlayer.* with split q/k/v and gate/up, and no q/k norm.
    assert sorted(tensors) == sorted(["fc.weight", "norm.weight", "midlayer.hidden_norm.weight",
                                      "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
                                      *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                                      *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))])
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (2 * 16, 2 * 32)  # q reads [E(x); h]
    check_vllm_folder(tmp_path / "vllm", load_target(llama_dir).config)

    code, out, err = run_cli(capsys, "import", "--format", "vllm", tmp_path / "vllm", tmp_path / "back", "--target",
                             llama_dir)
    assert code == 0, err
    same_weights(eagle3_dir, tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())["eagle3_config"]
    assert back == raw

    target = load_target(llama_dir)
    g = torch.Generator().manual_seed(1)
    taps = torch.randn(2, 7, 3 * 32, generator=g)
    tokens = torch.randint(0, target.config.vocab_size, (2, 7), generator=g)
    want = _eagle3_logits(eagle3_dir, target, taps, tokens)
    assert torch.equal(_eagle3_logits(tmp_path / "back", target, taps, tokens), want)


def _train_block(out: Path, llama_dir: Path, conversations: Path, kind: str, **overrides) -> Path:
    from angelspec.train.block import tiny_debug, train_block_drafter

    train_block_drafter(llama_dir, conversations, out, config=replace(tiny_debug(), drafter=kind, steps=2,
                                                                     **overrides), progress=False,
                        log=lambda *_: None)
    return out


@pytest.mark.parametrize(("kind", "overrides"), [("dflash", {}), ("dspark", {"context_injection": "shared"})])
def test_dflash_and_dspark_for_llama_get_qwen3_layers_and_export(tmp_path, llama_dir, conversations, capsys, kind,
                                                                 overrides):
    """vLLM's DFlash / DSpark classes build Qwen3 draft layers for any target, so new drafters get q/k norm."""
    src = _train_block(tmp_path / kind, llama_dir, conversations, kind, **overrides)
    block = json.loads((src / "config.json").read_text())["block_drafter_config"]
    assert block["qk_norm"] is True and block["model_type"] == "qwen3"
    prompts = write_domain_prompts(tmp_path / "prompts.jsonl")
    code, out, err = run_cli(capsys, "eval", "--target", llama_dir, "--drafter", src, "--prompts", prompts,
                             "--max-new-tokens", "8", "--quiet")
    assert code == 0 and "lossless: yes (3/3" in out, err
    result = export_drafter(src, tmp_path / "vllm", target=llama_dir)
    assert result.speculative_config["method"] == kind
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and "layers.0.self_attn.q_norm.weight" in read_tensors(
        tmp_path / "vllm" / "model.safetensors")
    if kind == "dflash":  # back in our layout: every tensor but the confidence head (vLLM's DFlash has none)
        import_vllm(tmp_path / "vllm", tmp_path / "back", target=llama_dir)
        ours, back = read_tensors(src / "model.safetensors"), read_tensors(tmp_path / "back" / "model.safetensors")
        assert {k: v for k, v in ours.items() if not k.startswith("confidence")}.keys() == back.keys()
        assert all(torch.equal(ours[k], back[k]) for k in back)


@pytest.mark.parametrize("kind", ["dflash", "dfly"])
def test_a_block_drafter_without_qk_norm_is_refused_naming_vllms_qwen3_layers(tmp_path, llama_dir, conversations,
                                                                              kind):
    from angelspec.models.block.config import BlockDrafterConfig

    src = _train_block(tmp_path / kind, llama_dir, conversations, kind)
    raw = json.loads((src / "config.json").read_text())
    raw["block_drafter_config"].update(qk_norm=False, model_type="llama")  # a drafter that took the target's layer
    BlockDrafterConfig.from_dict(raw["block_drafter_config"])
    (src / "config.json").write_text(json.dumps(raw))
    from safetensors.torch import save_file

    state = {k: v for k, v in read_tensors(src / "model.safetensors").items() if "_norm" not in k or "attn" not in k}
    save_file(state, str(src / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ExportRefused, match="no q/k norm.*Qwen3 draft layers"):
        export_drafter(src, tmp_path / "out", target=llama_dir)


def test_import_refuses_the_qwen3_eagle3_layout_for_a_llama_target(tmp_path, llama_dir, eagle3_dir):
    shutil.copytree(eagle3_dir, tmp_path / "src")
    export_drafter(tmp_path / "src", tmp_path / "vllm", target=llama_dir)
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    cfg.update(architectures=["Eagle3Qwen3ForCausalLM"], model_type="qwen3")
    (tmp_path / "vllm" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ImportRefused, match="Qwen3 EAGLE-3 layout.*LlamaForCausalLMEagle3"):
        import_vllm(tmp_path / "vllm", tmp_path / "back", target=llama_dir)


def test_other_families_are_refused_in_one_line(tmp_path, llama_dir, eagle3_dir, capsys):
    mistral = tmp_path / "mistral"
    shutil.copytree(llama_dir, mistral)
    cfg = json.loads((mistral / "config.json").read_text())
    cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    (mistral / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "export", "--format", "vllm", eagle3_dir, tmp_path / "out", "--target", mistral)
    assert_bad_input(code, err, "qwen3 and llama targets", "'qwen2'")


def _train_cli(capsys, tmp_path: Path, llama_dir: Path, conversations: Path, kind: str) -> dict:
    """`angelspec train --drafter KIND` for two steps on the Llama target, then `angelspec eval` (lossless); returns
    the drafter's config entry."""
    code, _, err = run_cli(capsys, "train", "--drafter", kind, "--target", llama_dir, "--data", conversations,
                           "--out", tmp_path / kind, "--preset", "tiny_debug", "--quiet", "steps=2")
    assert code == 0, err
    prompts = write_domain_prompts(tmp_path / "prompts.jsonl")
    code, out, err = run_cli(capsys, "eval", "--target", llama_dir, "--drafter", tmp_path / kind, "--prompts",
                             prompts, "--max-new-tokens", "8", "--quiet")
    assert code == 0 and "lossless: yes (3/3" in out, err
    raw = json.loads((tmp_path / kind / "config.json").read_text())
    return raw.get("mtp_config") or raw["block_drafter_config"]


LAYER = ("input_layernorm", "post_attention_layernorm", *(f"self_attn.{p}_proj" for p in "qkvo"),
         *(f"mlp.{p}_proj" for p in ("gate", "up", "down")))


def test_mtp_on_a_llama_target_exports_the_plugins_llama_layer(tmp_path, llama_dir, conversations, capsys):
    """MTP takes the target's layer (no q/k norm); the plugin's AngelSpecMTPEagle3 builds vLLM's Llama layer for
    model_type llama and loads our names with that layer split (layers.0.*), the one tap as EAGLE-3's aux layer."""
    cfg = _train_cli(capsys, tmp_path, llama_dir, conversations, "mtp")
    assert cfg["qk_norm"] is False and cfg["model_type"] == "llama"
    result = export_drafter(tmp_path / "mtp", tmp_path / "vllm", target=llama_dir)
    assert result.speculative_config["method"] == "eagle3"
    assert result.speculative_config["num_speculative_tokens"] == cfg["num_depths"]
    out = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert out["architectures"] == ["AngelSpecMTPEagle3"] and out["model_type"] == "llama"
    assert out["eagle_aux_hidden_state_layer_ids"] == [cfg["target_layer_id"] + 1]
    assert out["rope_scaling"] is None and out["rope_theta"] == 500000.0  # the drafter's plain RoPE, as ours
    assert out["target_hidden_size"] == out["hidden_size"] == 32 and out["num_hidden_layers"] == 1
    tensors = read_tensors(tmp_path / "vllm" / "model.safetensors")
    assert sorted(tensors) == sorted(["hidden_norm.weight", "embed_norm.weight", "proj.weight", "norm.weight",
                                      *(f"layers.0.{n}.weight" for n in LAYER)])
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (2 * 16, 32)  # the layer reads W_proj's output
    check_vllm_folder(tmp_path / "vllm", load_target(llama_dir).config)


def test_dfly_on_a_llama_target_gets_qwen3_layers_and_exports_for_the_plugin(tmp_path, llama_dir, conversations,
                                                                            capsys):
    """vLLM's DFlash-based classes (the plugin's DFly too) build Qwen3 draft layers for any target, so a new DFly
    gets q/k norm on a Llama target, decodes losslessly and exports every tensor under the names the plugin loads."""
    cfg = _train_cli(capsys, tmp_path, llama_dir, conversations, "dfly")
    assert cfg["qk_norm"] is True and cfg["model_type"] == "qwen3"
    result = export_drafter(tmp_path / "dfly", tmp_path / "vllm", target=llama_dir)
    assert result.speculative_config == {"method": "dflash", "model": str((tmp_path / "vllm").resolve()),
                                         "num_speculative_tokens": cfg["block_size"] - 1}
    out = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert out["architectures"] == ["AngelSpecDFlyDFlash"] and out["model_type"] == "qwen3"
    assert out["dflash_config"]["target_layer_ids"] == cfg["target_layer_ids"]
    assert out["rope_scaling"] is None and out["rope_theta"] == 500000.0
    assert out["angelspec_block"]["conditioning"] == "dfly"
    tensors = read_tensors(tmp_path / "vllm" / "model.safetensors")
    layers = cfg["num_draft_layers"]
    want = ["fusion_logits", "norm.weight", "fc.weight", *(f"context_norms.{i}.weight" for i in range(layers)),
            *(f"layers.{i}.{n}.weight" for i in range(layers) for n in (*LAYER, "self_attn.q_norm",
                                                                        "self_attn.k_norm"))]
    want += ["fc.bias"] if cfg["fc_bias"] else []
    want += [f"head.{n}.weight" for n in ("z_norm", "e_norm", "gate_up_proj", "down_proj")] \
        if cfg["head"] == "hidden" else []
    want += ["anchor_norm.weight", "anchor_fuse.weight"] if cfg["anchor_fusion"] else []
    want += ["lm_head.weight", "d2t"] if cfg["draft_vocab_size"] else []
    assert sorted(tensors) == sorted(want)
    check_vllm_folder(tmp_path / "vllm", load_target(llama_dir).config)
