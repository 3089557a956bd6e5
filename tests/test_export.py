"""`angelspec export --format vllm`: every tensor lands under vLLM's name with our values, tap ids are shifted where
vLLM counts differently, `d2t` maps draft ids to target ids, and drafters vLLM cannot represent are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_decoder

from angelspec.cli import main
from angelspec.export import ExportCheckError, ExportRefused, export_drafter
from angelspec.export.checks import check_vllm_folder, read_tensors
from angelspec.models import save_target
from angelspec.models.block.config import BlockDrafterConfig
from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.block.io import save_block_drafter
from angelspec.models.eagle3 import Eagle3Config, Eagle3DraftModel
from angelspec.models.mtp import MTPConfig, MTPDraftModel
from angelspec.models.mtp_io import save_mtp

LAYERS, VOCAB, MASK = 6, 64, 5


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    target = tiny_decoder(vocab=VOCAB, layers=LAYERS, dtype=torch.float32)
    path = tmp_path_factory.mktemp("target")
    save_target(target, path)
    return path, target


def _init(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + 0.01)  # every tensor distinct and non-zero
    return model


def _eagle3(target, draft_vocab: list[int] | None = None) -> Eagle3DraftModel:
    cfg = Eagle3Config.for_target(target.config, num_depths=3)
    if draft_vocab:
        cfg = Eagle3Config.from_dict({**cfg.to_dict(), "draft_vocab_size": len(draft_vocab)})
    model = _init(Eagle3DraftModel(cfg, target.embed_tokens, target.lm_head))
    if draft_vocab:
        model.set_draft_vocab(draft_vocab)
    return model


def _block(target, head: str = "none", conditioning: str = "dflash", confidence: bool = False,
           draft_vocab: list[int] | None = None, bias: str = "none", context_injection: str | None = "shared",
           anchor_fusion: bool = False) -> BlockDrafter:
    """A block drafter with every tensor non-zero except as `bias` says: "none" = an fc without bias (new DFlash /
    DSpark drafters), "zero" / "trained" = an fc bias (folders saved before fc_bias existed) held at zero / moved.
    `context_injection` None takes the new drafters' default (same-layer for a DSpark)."""
    cfg = BlockDrafterConfig.for_target(target.config, mask_token_id=MASK, block_size=4, num_draft_layers=2,
                                        conditioning=conditioning, head=head, markov_rank=8,
                                        confidence_head=confidence, context_injection=context_injection,
                                        fc_bias=None if bias == "none" else True, anchor_fusion=anchor_fusion)
    if draft_vocab:
        cfg = BlockDrafterConfig.from_dict({**cfg.to_dict(), "draft_vocab_size": len(draft_vocab)})
    model = _init(BlockDrafter(cfg, target.embed_tokens, target.lm_head))
    if draft_vocab:
        model.set_draft_vocab(draft_vocab)
    if bias == "zero":
        with torch.no_grad():
            model.fc.bias.zero_()
    return model


def _split_layer(ours: dict, src: str, dst: str, q: int, kv: int, inter: int) -> dict:
    qkv, gu = ours[f"{src}attn.qkv_proj.weight"], ours[f"{src}mlp.gate_up_proj.weight"]
    return {f"{dst}self_attn.q_proj.weight": qkv[:q], f"{dst}self_attn.k_proj.weight": qkv[q:q + kv],
            f"{dst}self_attn.v_proj.weight": qkv[q + kv:],
            f"{dst}self_attn.o_proj.weight": ours[f"{src}attn.o_proj.weight"],
            f"{dst}self_attn.q_norm.weight": ours[f"{src}attn.q_norm.weight"],
            f"{dst}self_attn.k_norm.weight": ours[f"{src}attn.k_norm.weight"],
            f"{dst}input_layernorm.weight": ours[f"{src}input_layernorm.weight"],
            f"{dst}post_attention_layernorm.weight": ours[f"{src}post_attention_layernorm.weight"],
            f"{dst}mlp.gate_proj.weight": gu[:inter], f"{dst}mlp.up_proj.weight": gu[inter:],
            f"{dst}mlp.down_proj.weight": ours[f"{src}mlp.down_proj.weight"]}


def _dflash_tensors(model) -> dict:
    """What a DFlash export must hold for our block drafter `model`: fc, hidden_norm, norm and each layer split into
    vLLM's / SGLang's q/k/v and gate/up tensors."""
    c = model.config
    ours = dict(model.state_dict())
    want = {"fc.weight": ours["fc.weight"], "hidden_norm.weight": ours["hidden_norm.weight"],
            "norm.weight": ours["norm.weight"]}
    for n in range(c.num_draft_layers):
        want.update(_split_layer(ours, f"layers.{n}.", f"layers.{n}.", c.num_attention_heads * c.head_dim,
                                 c.num_key_value_heads * c.head_dim, c.intermediate_size))
    return want


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("draft_vocab", [None, [40, 3, 7, 11, 0, 63, 20, 21]])
def test_eagle3_export_maps_every_tensor_shifts_taps_and_writes_d2t(target_dir, tmp_path, draft_vocab):
    path, target = target_dir
    model = _eagle3(target, draft_vocab)
    src = save_mtp(model, tmp_path / "eagle3")
    result = export_drafter(src, tmp_path / "out", target=path)
    out = tmp_path / "out"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 1
    taps = [i + 1 for i in model.config.target_layer_ids]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == taps == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert taps == [2, 4, 5]  # ours (1, 3, 4) for a 6-layer target
    c = model.config
    ours = {k: v for k, v in model.state_dict().items() if k != "draft_vocab"}
    want = {"fc.weight": ours["fc.weight"], "midlayer.hidden_norm.weight": ours["hidden_norm.weight"],
            "norm.weight": ours["norm.weight"],
            **_split_layer(ours, "layer.", "midlayer.", c.num_attention_heads * c.head_dim,
                           c.num_key_value_heads * c.head_dim, c.intermediate_size)}
    assert want["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * c.hidden_size
    if draft_vocab:
        ids = torch.tensor(draft_vocab)
        want["lm_head.weight"] = target.lm_head.weight.detach()[ids]
        want["d2t"] = ids - torch.arange(len(ids))
        assert cfg["draft_vocab_size"] == len(draft_vocab)
    else:
        assert cfg["draft_vocab_size"] == VOCAB
    got = read_tensors(out / "model.safetensors")
    _assert_same(got, want)
    if draft_vocab:  # target id = draft id + d2t[draft id]
        assert (torch.arange(len(draft_vocab)) + got["d2t"]).tolist() == draft_vocab
        assert got["d2t"].dtype == torch.int64
    spec = json.loads((out / "speculative_config.json").read_text())
    assert spec == result.speculative_config == {"method": "eagle3", "model": str(out.resolve()),
                                                 "num_speculative_tokens": 3}


@pytest.mark.parametrize(("head", "confidence", "draft_vocab"),
                         [("none", False, None), ("none", True, [9, 8, 7, 6]), ("markov", True, None),
                          ("markov", False, [1, 2, 30, 40, 50])])
@pytest.mark.parametrize("bias", ["none", "zero"])
def test_dflash_and_dspark_export(target_dir, tmp_path, head, confidence, draft_vocab, bias):
    path, target = target_dir
    model = _block(target, head=head, confidence=confidence, draft_vocab=draft_vocab, bias=bias)
    assert (model.fc.bias is None) == (bias == "none")
    src = save_block_drafter(model, tmp_path / "block")
    result = export_drafter(src, tmp_path / "out", target=path)
    out = tmp_path / "out"
    cfg = json.loads((out / "config.json").read_text())
    c = model.config
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": list(c.target_layer_ids)}
    assert cfg["num_hidden_layers"] == 2 and cfg["rope_theta"] == c.rope_theta
    assert cfg["rope_parameters"]["rope_theta"] == c.rope_theta
    ours, want = dict(model.state_dict()), _dflash_tensors(model)
    assert want["fc.weight"].shape == (c.hidden_size, c.num_taps * c.hidden_size)
    ids = torch.tensor(draft_vocab) if draft_vocab else None
    if head == "markov":
        assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["sample_from_anchor"] is False
        assert cfg["markov_rank"] == 8 and cfg["markov_head_type"] == "vanilla"
        w2 = ours["head.out.weight"]
        want["markov_head.markov_w1.weight"] = ours["head.embed.weight"]
        want["markov_head.markov_w2.weight"] = w2 if ids is None else w2[ids]
        if confidence:
            want["confidence_head.proj.weight"] = ours["confidence.proj.weight"]
            want["confidence_head.proj.bias"] = ours["confidence.proj.bias"]
        assert result.speculative_config["method"] == "dspark"
    else:
        assert cfg["architectures"] == ["DFlashDraftModel"]
        assert result.speculative_config["method"] == "dflash"
        assert bool(result.notes) == confidence
    if ids is not None:
        want["lm_head.weight"] = target.lm_head.weight.detach()[ids]
        want["d2t"] = ids - torch.arange(len(ids))
    _assert_same(read_tensors(out / "model.safetensors"), want)
    assert result.speculative_config["num_speculative_tokens"] == c.block_size - 1 == 3


def test_a_protocol_confidence_head_exports_its_greedy_output(target_dir, tmp_path):
    path, target = target_dir
    cfg = BlockDrafterConfig.for_target(target.config, mask_token_id=MASK, block_size=4, num_draft_layers=2,
                                        conditioning="dflash", head="markov", markov_rank=8,
                                        confidence_target="protocol", confidence_temperatures=(0.0, 0.5, 1.0),
                                        context_injection="shared")  # what vLLM's DSpark serves (no fc bias)
    model = _init(BlockDrafter(cfg, target.embed_tokens, target.lm_head))
    result = export_drafter(save_block_drafter(model, tmp_path / "block"), tmp_path / "out", target=path)
    got = read_tensors(tmp_path / "out" / "model.safetensors")
    w, b = got["confidence_head.proj.weight"], got["confidence_head.proj.bias"]
    assert w.shape == (1, cfg.hidden_size + 8) and b.shape == (1,)
    h, e = torch.randn(5, cfg.hidden_size), torch.randn(5, 8)
    with torch.no_grad():  # vLLM's one-output head computes what ours does for a greedy row
        torch.testing.assert_close((torch.cat([h, e], -1) @ w.t() + b)[:, 0], model.confidence(h, e, torch.zeros(5)))
    assert any("T = 0" in n for n in result.notes)


def test_draft_lm_is_copied(target_dir, tmp_path):
    path, target = target_dir
    lm = tiny_decoder(vocab=VOCAB, layers=1, dtype=torch.float32)
    save_target(lm, tmp_path / "lm")
    result = export_drafter(tmp_path / "lm", tmp_path / "out", target=path)
    assert result.speculative_config["method"] == "draft_model"
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "lm" / "model.safetensors").read_bytes()
    assert not result.notes


def test_draft_lm_with_a_draft_vocabulary_is_copied_with_a_note(target_dir, tmp_path):
    """vLLM's draft_model drafts from the whole vocabulary (`make vllm-check` runs ours the same way)."""
    path, target = target_dir
    save_target(tiny_decoder(vocab=VOCAB, layers=1, dtype=torch.float32), tmp_path / "lm")
    cfg = json.loads((tmp_path / "lm" / "config.json").read_text())
    cfg["angelspec"] = {"drafter": "draft-lm", "draft_vocab": [1, 2, 3, 4]}
    (tmp_path / "lm" / "config.json").write_text(json.dumps(cfg))
    result = export_drafter(tmp_path / "lm", tmp_path / "out", target=path)
    assert len(result.notes) == 1 and "whole vocabulary" in result.notes[0]


@pytest.mark.parametrize(("build", "words"), [
    (lambda t: _block(t, head="hidden", confidence=False), "hidden-correction"),
    (lambda t: _block(t, head="gated", confidence=False), "gated"),
    (lambda t: _block(t, head="rnn", confidence=False), "rnn"),
    (lambda t: _block(t, conditioning="dfly", head="markov", confidence=False), "dfly"),
    (lambda t: _block(t, conditioning="dfly", head="gated", confidence=False), "gated head"),
    (lambda t: _block(t, bias="trained"), r"fc\.bias.*fc_bias=false"),
    (lambda t: _block(t, head="markov", context_injection=None), "same_layer.*context_injection=shared"),
    (lambda t: _block(t, anchor_fusion=True), "fused anchor input.*anchor_fusion=false"),
])
def test_refusals_name_what_does_not_fit(target_dir, tmp_path, build, words):
    path, target = target_dir
    src = save_block_drafter(build(target), tmp_path / "src")
    with pytest.raises(ExportRefused, match=words):
        export_drafter(src, tmp_path / "out", target=path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("draft_vocab", [None, [40, 3, 7, 11, 0, 63, 20, 21]])
def test_mtp_exports_for_the_plugin_with_its_one_tap_shifted(target_dir, tmp_path, draft_vocab):
    """MTP goes to the angelspec[vllm] plugin's class, driven by vLLM's EAGLE-3 proposer: our tensor names, the layer
    split into vLLM's, the one tap as EAGLE-3's only auxiliary layer (our id + 1)."""
    path, target = target_dir
    cfg = MTPConfig.for_target(target.config)
    if draft_vocab:
        cfg = MTPConfig.from_dict({**cfg.to_dict(), "draft_vocab_size": len(draft_vocab)})
    model = _init(MTPDraftModel(cfg, target.embed_tokens, target.lm_head))
    if draft_vocab:
        model.set_draft_vocab(draft_vocab)
    result = export_drafter(save_mtp(model, tmp_path / "mtp"), tmp_path / "out", target=path)
    assert result.speculative_config["method"] == "eagle3" and result.speculative_config["num_speculative_tokens"] == 3
    assert "angelspec[vllm] plugin" in result.notes[0]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["AngelSpecMTPEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [LAYERS] == [cfg.target_layer_id + 1]
    ours = dict(model.state_dict())
    want = {n: ours[n] for n in ("hidden_norm.weight", "embed_norm.weight", "proj.weight", "norm.weight")}
    want.update(_split_layer(ours, "layer.", "layers.0.", cfg.num_attention_heads * cfg.head_dim,
                             cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size))
    if draft_vocab:
        ids = torch.tensor(draft_vocab)
        want["lm_head.weight"] = target.lm_head.weight.detach()[ids]
        want["d2t"] = ids - torch.arange(len(draft_vocab))
    _assert_same(read_tensors(tmp_path / "out" / "model.safetensors"), want)


@pytest.mark.parametrize(("conditioning", "head", "anchor_fusion"), [
    ("dfly", "hidden", True), ("dfly", "none", False), ("dflare", "hidden", False)])
def test_dfly_and_dflare_export_for_the_plugin(target_dir, tmp_path, conditioning, head, anchor_fusion):
    """DFly / DFlare go to the plugin's class, driven by vLLM's DFlash proposer: every tensor of the per-layer fusion,
    the hidden-correction head and the fused anchor input under our name, the layers split, 0-based taps."""
    path, target = target_dir
    model = _block(target, head=head, conditioning=conditioning, confidence=True, anchor_fusion=anchor_fusion,
                   bias="none" if conditioning == "dflare" else "trained")
    result = export_drafter(save_block_drafter(model, tmp_path / "src"), tmp_path / "out", target=path)
    c = model.config
    assert result.speculative_config["method"] == "dflash"
    assert result.speculative_config["num_speculative_tokens"] == c.block_size - 1
    assert any("confidence head was left out" in n for n in result.notes)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["AngelSpecDFlyDFlash"]
    assert config["dflash_config"]["target_layer_ids"] == list(c.target_layer_ids)
    assert config["angelspec_block"] == {"conditioning": conditioning, "head": head, "fc_bias": c.fc_bias,
                                         "anchor_fusion": anchor_fusion,
                                         "head_intermediate_size": c.head_intermediate_size or c.hidden_size}
    ours = {n: t for n, t in model.state_dict().items() if not n.startswith(("confidence", "layers."))}
    for n in range(c.num_draft_layers):
        ours.update(_split_layer(dict(model.state_dict()), f"layers.{n}.", f"layers.{n}.",
                                 c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                                 c.intermediate_size))
    assert ("fc.bias" in ours) is (conditioning == "dfly") and ("head.down_proj.weight" in ours) is (head == "hidden")
    _assert_same(read_tensors(tmp_path / "out" / "model.safetensors"), ours)


def test_check_catches_a_broken_export(target_dir, tmp_path):
    path, target = target_dir
    src = save_mtp(_eagle3(target), tmp_path / "eagle3")
    export_drafter(src, tmp_path / "out", target=path)
    out = tmp_path / "out"
    tensors = read_tensors(out / "model.safetensors")
    from safetensors.torch import save_file
    del tensors["midlayer.self_attn.k_norm.weight"]
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ExportCheckError, match="k_norm") as e:
        check_vllm_folder(out, target.config)
    assert "fc.weight" in str(e.value)
    export_drafter(src, out, target=path, force=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 4, 5]
    (out / "config.json").write_text(json.dumps(cfg))  # our unshifted low tap: "before layer 0" does not exist
    with pytest.raises(ExportCheckError, match="tap ids"):
        check_vllm_folder(out, target.config)


def test_cli_export_prints_the_speculative_config_and_refuses(target_dir, tmp_path, capsys):
    path, target = target_dir
    src = save_mtp(_eagle3(target), tmp_path / "eagle3")
    out = tmp_path / "out"
    assert main(["export", "--format", "vllm", str(src), str(out), "--target", str(path)]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1])["method"] == "eagle3"
    assert main(["export", str(src), str(out), "--target", str(path)]) == 2  # not empty without --force
    assert "--force" in capsys.readouterr().err
    assert main(["export", str(src), str(out), "--target", str(path), "--force"]) == 0
    gated = save_block_drafter(_block(target, head="gated"), tmp_path / "gated")
    assert main(["export", str(gated), str(tmp_path / "o2"), "--target", str(path)]) == 2
    assert "gated" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Trained drafters (`tiny_debug`, one step) on a 6-layer target folder with the tiny tokenizer
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deep_target_dir(tmp_path_factory, tiny_target_dir) -> Path:
    import shutil
    from dataclasses import replace

    from angelspec.models import Decoder, load_target

    out = tmp_path_factory.mktemp("export_target") / "t"
    shutil.copytree(tiny_target_dir, out)
    model = Decoder(replace(load_target(tiny_target_dir).config, num_hidden_layers=LAYERS))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_target(model, out)
    return out


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    import conftest

    return conftest.write_conversations(tmp_path_factory.mktemp("export_data") / "conv.jsonl", 40, seed=3)


def _ours(path: Path) -> dict:
    return read_tensors(path / "model.safetensors")


def test_trained_eagle3_with_a_draft_vocab_exports_exactly(tmp_path, deep_target_dir, conversations):
    from dataclasses import replace

    from angelspec.models import load_target
    from angelspec.train.draft_vocab import apply_draft_vocab
    from angelspec.train.eagle3 import tiny_debug, train_eagle3

    src = tmp_path / "eagle3"
    train_eagle3(deep_target_dir, conversations, src, config=replace(tiny_debug(), steps=1), progress=False,
                 log=lambda *_: None)
    apply_draft_vocab(src, conversations, 24, target=deep_target_dir, force=True)  # in place
    export_drafter(src, tmp_path / "out", target=deep_target_dir)
    ours, got = _ours(src), _ours(tmp_path / "out")
    raw = json.loads((src / "config.json").read_text())
    c = Eagle3Config.from_dict(raw["eagle3_config"])
    vocab = ours.pop("draft_vocab")
    assert c.draft_vocab_size == vocab.numel() > 0
    want = {"fc.weight": ours["fc.weight"], "midlayer.hidden_norm.weight": ours["hidden_norm.weight"],
            "norm.weight": ours["norm.weight"],
            **_split_layer(ours, "layer.", "midlayer.", c.num_attention_heads * c.head_dim,
                           c.num_key_value_heads * c.head_dim, c.intermediate_size),
            "lm_head.weight": load_target(deep_target_dir).lm_head.weight.detach()[vocab],
            "d2t": vocab - torch.arange(vocab.numel())}
    _assert_same(got, want)
    assert (torch.arange(vocab.numel()) + got["d2t"]).tolist() == vocab.tolist()
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in c.target_layer_ids]


def test_trained_dspark_is_refused_for_its_bias_and_exports_once_it_is_zero(tmp_path, deep_target_dir,
                                                                            conversations):
    from dataclasses import replace

    from safetensors.torch import save_file

    from angelspec.train.block import BlockDrafterTrainConfig, tiny_debug, train_block_drafter

    src = tmp_path / "dspark"
    # The shared context with a biased fc and a one-output "tv" confidence head: what DSpark trained with before
    # context_injection / fc_bias / confidence_target existed.
    cfg = replace(tiny_debug(), drafter="dspark", head="markov", steps=1, context_injection="shared", fc_bias=True,
                  confidence_target="tv")
    assert isinstance(cfg, BlockDrafterTrainConfig)
    train_block_drafter(deep_target_dir, conversations, src, config=cfg, progress=False, log=lambda *_: None)
    with pytest.raises(ExportRefused, match=r"fc\.bias"):  # training moved the bias vLLM's fc does not have
        export_drafter(src, tmp_path / "out", target=deep_target_dir)
    ours = _ours(src)
    ours["fc.bias"] = torch.zeros_like(ours["fc.bias"])
    save_file(ours, str(src / "model.safetensors"), {"format": "pt"})
    result = export_drafter(src, tmp_path / "out", target=deep_target_dir)
    block = BlockDrafterConfig.from_dict(json.loads((src / "config.json").read_text())["block_drafter_config"])
    want = {"fc.weight": ours["fc.weight"], "hidden_norm.weight": ours["hidden_norm.weight"],
            "norm.weight": ours["norm.weight"], "markov_head.markov_w1.weight": ours["head.embed.weight"],
            "markov_head.markov_w2.weight": ours["head.out.weight"]}
    if block.confidence_head:
        want["confidence_head.proj.weight"] = ours["confidence.proj.weight"]
        want["confidence_head.proj.bias"] = ours["confidence.proj.bias"]
    for n in range(block.num_draft_layers):
        want.update(_split_layer(ours, f"layers.{n}.", f"layers.{n}.", block.num_attention_heads * block.head_dim,
                                 block.num_key_value_heads * block.head_dim, block.intermediate_size))
    _assert_same(_ours(tmp_path / "out"), want)
    assert result.speculative_config["num_speculative_tokens"] == block.block_size - 1
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["dflash_config"]["target_layer_ids"] == list(block.target_layer_ids)


@pytest.mark.parametrize(("kind", "overrides"), [("dflash", {}), ("dspark", {"context_injection": "shared"})])
def test_freshly_trained_dflash_and_dspark_have_no_fc_bias_and_export(tmp_path, deep_target_dir, conversations,
                                                                        kind, overrides):
    from dataclasses import replace

    from angelspec.train.block import tiny_debug, train_block_drafter

    src = tmp_path / kind
    cfg = replace(tiny_debug(), drafter=kind, steps=1, **overrides)
    train_block_drafter(deep_target_dir, conversations, src, config=cfg, progress=False, log=lambda *_: None)
    block = json.loads((src / "config.json").read_text())["block_drafter_config"]
    assert block["fc_bias"] is False and "fc.bias" not in _ours(src) and "fc.weight" in _ours(src)
    result = export_drafter(src, tmp_path / "out", target=deep_target_dir)
    assert result.speculative_config["method"] == kind
    if kind == "dspark":  # the default DSpark injects each layer's own tap: no fc at all, which vLLM cannot serve
        default = tmp_path / "same_layer"
        train_block_drafter(deep_target_dir, conversations, default, config=replace(cfg, context_injection=None),
                            progress=False, log=lambda *_: None)
        assert "fc.weight" not in _ours(default)
        with pytest.raises(ExportRefused, match="context_injection=shared"):
            export_drafter(default, tmp_path / "out2", target=deep_target_dir)


# ---------------------------------------------------------------------------------------------------------
# `angelspec import --format vllm`: a vLLM folder back into our drafter (the inverse of the export)
# ---------------------------------------------------------------------------------------------------------


def _drafts(folder: Path, target, target_path: Path) -> tuple[list, list]:
    """Greedy speculative decoding of three prompts with the drafter in `folder`: (every proposal's tokens, outputs)."""
    from conftest import record_proposals

    from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
    from angelspec.decoding.loading import resolve_drafter

    drafter = resolve_drafter(str(folder), target, target_path)
    seen = record_proposals(drafter)
    reqs = [Request(prompt_ids=[3 + i, 9, 17 + i, 30], max_new_tokens=24, stop_ids=()) for i in range(3)]
    out = SpecEngine(target, drafter, EngineConfig(max_batch_size=2, num_draft_tokens=3)).generate(reqs)
    return [p.tokens.tolist() for p in seen], [r.token_ids for r in out]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("kind", "draft_vocab"), [("eagle3", None), ("eagle3", [40, 3, 7, 11, 0, 63, 20, 21]),
                                                   ("dflash", None), ("dflash", [9, 8, 7, 6, 5, 1, 2])])
def test_import_round_trip_gives_the_same_weights_config_and_drafts(target_dir, tmp_path, kind, draft_vocab):
    from conftest import same_weights

    from angelspec.export.vllm_import import import_vllm

    path, target = target_dir
    if kind == "eagle3":
        src = save_mtp(_eagle3(target, draft_vocab), tmp_path / "src")
    else:
        src = save_block_drafter(_block(target, draft_vocab=draft_vocab), tmp_path / "src")
    export_drafter(src, tmp_path / "vllm", target=path)
    result = import_vllm(tmp_path / "vllm", tmp_path / "back", target=path)
    back = tmp_path / "back"
    assert result.kind == kind and not result.notes
    same_weights(src, back)
    key = "eagle3_config" if kind == "eagle3" else "block_drafter_config"
    raw_src, raw_back = (json.loads((p / "config.json").read_text()) for p in (src, back))
    unused = {"markov_rank"} if kind == "dflash" else set()  # DFlash has no Markov head: vLLM's config has no rank
    assert {k: v for k, v in raw_back[key].items() if k not in unused} == \
        {k: v for k, v in raw_src[key].items() if k not in unused}
    assert raw_back["angelspec"]["imported_from"] == str((tmp_path / "vllm").resolve())
    drafts, outputs = _drafts(src, target, path)
    assert _drafts(back, target, path) == (drafts, outputs) and len(drafts) > 3


def _vllm_eagle3(target_dir, tmp_path) -> Path:
    path, target = target_dir
    src = save_mtp(_eagle3(target, [40, 3, 7, 11, 0, 63, 20, 21]), tmp_path / "src")
    export_drafter(src, tmp_path / "vllm", target=path)
    return tmp_path / "vllm"


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder: Path, edit) -> None:
    from safetensors.torch import save_file

    tensors = read_tensors(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize(("edit", "words"), [
    (lambda d: _edit_config(d, architectures=["LlamaForCausalLMEagle3"]), "LLaMA EAGLE-3 layout"),
    (lambda d: _edit_config(d, norm_before_fc=True), "norm_before_fc=True"),
    (lambda d: _edit_config(d, eagle_aux_hidden_state_layer_ids=None, eagle_config={}), "three strictly increasing"),
    (lambda d: _edit_config(d, hidden_size=96), "hidden 96"),
    (lambda d: _edit_tensors(d, lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"] + 1)), "own lm_head"),
    (lambda d: _edit_tensors(d, lambda t: t.pop("midlayer.self_attn.k_proj.weight")), "k_proj"),
    (lambda d: _edit_tensors(d, lambda t: t.__setitem__("extra.weight", torch.zeros(2))), "extra.weight"),
    (lambda d: _edit_tensors(d, lambda t: t.__setitem__("d2t", -torch.arange(8))), "distinct target ids"),
])
def test_import_refuses_what_our_drafter_cannot_compute_in_one_line(target_dir, tmp_path, capsys, edit, words):
    from conftest import assert_bad_input, run_cli

    folder = _vllm_eagle3(target_dir, tmp_path)
    edit(folder)
    code, _, err = run_cli(capsys, "import", folder, tmp_path / "out", "--target", target_dir[0])
    assert_bad_input(code, err, words)
    assert not (tmp_path / "out").exists()


def test_import_cli_writes_a_folder_eval_loads_and_refuses_a_bad_folder(target_dir, tmp_path, capsys):
    from conftest import assert_bad_input, run_cli

    from angelspec.decoding.loading import resolve_drafter

    path, target = target_dir
    folder = _vllm_eagle3(target_dir, tmp_path)
    code, out, _ = run_cli(capsys, "import", "--format", "vllm", folder, tmp_path / "back", "--target", path)
    assert code == 0 and f"--drafter {tmp_path / 'back'}" in out
    assert resolve_drafter(str(tmp_path / "back"), target, path).target_layer_ids == (1, 3, 4)
    assert_bad_input(*run_cli(capsys, "import", folder, tmp_path / "back", "--target", path)[::2], "--force")
    assert_bad_input(*run_cli(capsys, "import", tmp_path / "nowhere", tmp_path / "o", "--target", path)[::2],
                     "config.json")
    mtp = json.loads((folder / "config.json").read_text())
    _edit_config(folder, architectures=["Qwen3DSparkModel"], dflash_config={"mask_token_id": 5})
    assert_bad_input(*run_cli(capsys, "import", folder, tmp_path / "o2", "--target", path)[::2], "Qwen3DSparkModel",
                     "DFlashDraftModel")
    assert mtp["architectures"] == ["Eagle3Qwen3ForCausalLM"]
