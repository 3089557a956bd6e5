"""Defaults that fit the drafter and the target: K is the drafter's trained depth in every command, a block
drafter's taps follow the target it is trained for, the preset follows the target's size, and the mask token is
settled (or refused) before any work."""

from __future__ import annotations

import json
import shutil

import pytest

from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET
from angelspec.models import DecoderConfig
from tests import conftest


def decoder_config(layers: int, hidden: int = 64, vocab: int = 8192) -> DecoderConfig:
    return DecoderConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden // 4, max_position_embeddings=1024)


# ----- K: the drafter's trained depth -----


@pytest.fixture(scope="module")
def embedded():
    from angelspec.decoding.loading import load_target_and_tokenizer

    return load_target_and_tokenizer(DEFAULT_TARGET)[0]


@pytest.mark.parametrize("spec,k", [("dfly", 7), ("dspark", 7), ("mtp", 3), ("eagle3", 3), ("dfly+ngram", 7),
                                    ("ngram", 4)])
def test_every_drafter_drafts_its_trained_depth_by_default(embedded, spec, k) -> None:
    from angelspec.decoding.loading import draft_depth, resolve_drafter

    full = spec if spec == "ngram" else str(DEFAULT_DRAFTERS / spec)
    drafter = resolve_drafter(full, embedded, DEFAULT_TARGET)
    assert draft_depth(drafter) == k
    assert draft_depth(drafter, 2) == 2  # --num-draft-tokens wins
    assert draft_depth(None) == 4


def test_generate_and_eval_default_to_the_trained_depth(tmp_path, capsys) -> None:
    from angelspec.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 + 3?", "domain": "math"}) + "\n", encoding="utf-8")
    dfly = str(DEFAULT_DRAFTERS / "dfly")
    assert main(["generate", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--drafter", dfly,
                 "--max-new-tokens", "6", "--quiet"]) == 0
    assert "with K=7" in capsys.readouterr().out  # the shipped DFly was trained for blocks of 8
    assert main(["eval", "--prompts", str(prompts), "--drafter", dfly, "--drafter", "ngram", "--max-new-tokens", "6",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"{dfly} (K=7)" in out and "ngram (K=4)" in out  # each drafter its own depth, one AR run


# ----- taps follow the target -----


@pytest.mark.parametrize("preset", ["dfly_embedded", "dflash_embedded", "dspark_embedded", "dfly_demo"])
@pytest.mark.parametrize("layers,taps", [(6, (1, 3, 5)), (12, (1, 5, 9)), (2, (0, 1)), (36, (1, 17, 33))])
def test_block_presets_spread_their_taps_over_the_target(preset, layers, taps) -> None:
    from angelspec.train.block import PRESETS

    cfg = PRESETS[preset]()
    model = cfg.model_config(decoder_config(layers), mask_token_id=5)
    assert model.target_layer_ids == taps  # the embedded target's (1, 3, 5) only where the target has its 6 layers


def test_taps_named_for_a_run_are_used_as_given() -> None:
    from angelspec.train.block import PRESETS
    from angelspec.train.runs import preset_config

    cfg = preset_config(PRESETS, "dfly_embedded", "dfly_embedded", ["target_layer_ids=2,4"])
    assert cfg.model_config(decoder_config(12), mask_token_id=5).target_layer_ids == (2, 4)


def test_dfly_trains_on_a_two_layer_target(tmp_path, tiny_target_dir) -> None:
    """The default dfly preset on the 2-layer tiny target (it had the embedded target's taps 1, 3, 5: "do not
    fit")."""
    from angelspec.train.runs import TrainSettings, train_drafter

    data = conftest.write_conversations(tmp_path / "conv.jsonl", 12, seed=3)
    settings = TrainSettings(overrides=("steps=1", "seq_len=64", "batch_size=1", "num_anchors=2", "warmup=1"),
                             progress=False)
    result = train_drafter("dfly", data, tmp_path / "d", settings, target=tiny_target_dir, log=lambda _: None)
    config = json.loads((result.out / "config.json").read_text(encoding="utf-8"))
    assert config["angelspec"]["target_layer_ids"] == [0, 1]


def test_preset_rows_are_cut_to_a_short_target_context(tmp_path, tiny_target_dir) -> None:
    """dfly_embedded packs 512-token rows; the tiny target's context is 256: the rows follow it (a seq_len the run
    names itself is refused instead, tests/test_bad_input.py)."""
    from angelspec.train.runs import TrainSettings, train_drafter

    data = conftest.write_conversations(tmp_path / "conv.jsonl", 12, seed=3)
    said: list[str] = []
    settings = TrainSettings(overrides=("steps=1", "batch_size=1", "num_anchors=2", "warmup=1"), progress=False)
    result = train_drafter("dfly", data, tmp_path / "d", settings, target=tiny_target_dir, log=said.append)
    assert any(line.startswith(f"seq_len {conftest.TINY_CONTEXT}:") for line in said), said
    config = json.loads((result.out / "config.json").read_text(encoding="utf-8"))
    assert config["angelspec"]["train_config"]["seq_len"] == conftest.TINY_CONTEXT


def test_eagle3_taps_on_small_targets() -> None:
    from angelspec.models.eagle3 import default_eagle3_layer_ids

    assert default_eagle3_layer_ids(36) == (1, 18, 34)
    assert default_eagle3_layer_ids(6) == (1, 3, 4)
    assert default_eagle3_layer_ids(4) == (0, 2, 3)


# ----- the preset follows the target's size -----


def test_preset_is_chosen_from_the_target_size(tmp_path) -> None:
    from angelspec.train.registry import preset_for_target
    from angelspec.train.runs import chosen_preset

    assert preset_for_target("dfly", 6_800_000) == "dfly_embedded"
    assert preset_for_target("dfly", 8_000_000_000) == "qwen3_8b_dfly"
    assert preset_for_target("dspark", 600_000_000) == "qwen3_8b_dspark"
    assert preset_for_target("mtp", 8_000_000_000) == "mtp_embedded"  # no real-size MTP preset: the default
    big = tmp_path / "qwen3-8b"
    big.mkdir()
    shape = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                 intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                 tie_word_embeddings=False)
    (big / "config.json").write_text(json.dumps(shape), encoding="utf-8")
    said: list[str] = []
    assert chosen_preset("dfly", big, said.append) == "qwen3_8b_dfly"
    assert "real-size" in said[0] and "--preset" in said[0]
    assert chosen_preset("dfly", DEFAULT_TARGET, said.append) == "dfly_embedded"


# ----- the mask token, before any work -----


class FakeToken:
    def __init__(self, content: str, special: bool = True) -> None:
        self.content, self.special = content, special


class FakeBackend:
    def __init__(self, added: dict[int, FakeToken]) -> None:
        self.added = added

    def get_added_tokens_decoder(self) -> dict[int, FakeToken]:
        return self.added


class FakeTokenizer:
    mask_token_id = None

    def __init__(self, size: int, added: dict[int, FakeToken]) -> None:
        self.size, self.backend = size, FakeBackend(added)

    def __len__(self) -> int:
        return self.size


def test_mask_token_candidates() -> None:
    from angelspec.train.block import mask_token_candidates

    llama = FakeTokenizer(128256, {128000: FakeToken("<|begin_of_text|>"),
                                   128002: FakeToken("<|reserved_special_token_0|>"),
                                   128003: FakeToken("<|reserved_special_token_1|>")})
    assert mask_token_candidates(llama, 128256)[0] == (128002, "<|reserved_special_token_0|>")
    qwen3 = FakeTokenizer(151669, {151643: FakeToken("<|endoftext|>"), 151644: FakeToken("<|im_start|>")})
    assert mask_token_candidates(qwen3, 151936) == [(151669, "an embedding row no token of the tokenizer uses")]
    assert mask_token_candidates(FakeTokenizer(100, {}), 100) == []


def test_a_target_without_a_free_mask_token_is_refused_before_any_work(tmp_path, tiny_target_dir, capsys) -> None:
    """No mask token, no reserved special token, no spare embedding row: one line naming mask_token_id, before
    the weights are read (the folder has none) and before anything is written."""
    from angelspec.cli import main

    target = tmp_path / "target"
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_target_dir / name).is_file():
            text = (tiny_target_dir / name).read_text(encoding="utf-8").replace("<|mask|>", "<|tool|>")
            data = json.loads(text)
            if isinstance(data, dict):
                data.pop("mask_token", None)
            (target / name).write_text(json.dumps(data), encoding="utf-8")
    data = conftest.write_conversations(tmp_path / "conv.jsonl", 4, seed=1)
    code = main(["train", "--drafter", "dfly", "--target", str(target), "--data", str(data), "--out",
                 str(tmp_path / "o"), "--quiet", "seq_len=64"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "no mask token" in err and "mask_token_id=" in err
    assert not (tmp_path / "o").exists()
    shutil.rmtree(target)
