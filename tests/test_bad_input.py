"""Bad input through `main([...])` gives one error line and exit code 2, with a message naming the problem and the fix:
weights that disagree with their config.json (targets, draft LMs, MTP and block drafters), --data files that hold no
conversations, a seq_len beyond the target's context, and a damaged training checkpoint on --resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_bad_input, run_cli

from angelspec.cli import main


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    return run_cli(capsys, *args)


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "def add(x, y):"}) + "\n")
    return path


def edited_copy(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def generate(capsys: pytest.CaptureFixture[str], tmp_path: Path, prompts: Path, target: Path, *extra: object
             ) -> tuple[int, str, str]:
    return run(capsys, "generate", "--prompts", prompts, "--out", tmp_path / "o.jsonl", "--force", "--target", target,
               "--max-new-tokens", 2, "--quiet", *extra)


# ----- weights against config.json -----


def test_target_config_with_fewer_layers_than_the_weights(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                          prompts_file: Path, tiny_target_dir: Path) -> None:
    """The unused tensors of layer 1 used to be dropped silently: a 1-layer model ran on 2-layer weights."""
    short = edited_copy(tiny_target_dir, tmp_path / "short", num_hidden_layers=1)
    code, _, err = generate(capsys, tmp_path, prompts_file, short)
    assert_bad_input(code, err, str(short), "weights do not match config.json", "unexpected",
                     "model.layers.1.", "is it the config of these weights?")
    deep = edited_copy(tiny_target_dir, tmp_path / "deep", num_hidden_layers=3)
    code, _, err = generate(capsys, tmp_path, prompts_file, deep)
    assert_bad_input(code, err, str(deep), "missing", "model.layers.2.")


def test_target_config_with_another_vocab_size(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               prompts_file: Path, tiny_target_dir: Path) -> None:
    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    other = edited_copy(tiny_target_dir, tmp_path / "other", vocab_size=vocab + 7)
    code, _, err = generate(capsys, tmp_path, prompts_file, other)
    assert_bad_input(code, err, str(other), "'model.embed_tokens.weight' has shape", f"[{vocab}, 32]",
                     f"implies [{vocab + 7}, 32]", "different models")


def test_draft_lm_config_with_another_vocab_size(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 prompts_file: Path, tiny_target_dir: Path) -> None:
    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    draft = edited_copy(tiny_target_dir, tmp_path / "draft", vocab_size=vocab - 5)
    code, _, err = generate(capsys, tmp_path, prompts_file, tiny_target_dir, "--drafter", f"draft-lm:{draft}")
    assert_bad_input(code, err, str(draft), "has shape", f"implies [{vocab - 5}, 32]")


def test_absurd_config_sizes_are_refused_before_allocating(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           prompts_file: Path, tiny_target_dir: Path) -> None:
    """hidden_size 10^9 would ask for terabytes: refused from the config and the file sizes alone."""
    huge = edited_copy(tiny_target_dir, tmp_path / "huge", hidden_size=10**9, head_dim=16)
    code, _, err = generate(capsys, tmp_path, prompts_file, huge)
    assert_bad_input(code, err, str(huge), "config.json implies", "parameters", "TB", "weights hold only",
                     "does not describe these weights")


def test_truncated_target_weights_name_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                prompts_file: Path, tiny_target_dir: Path) -> None:
    cut = tmp_path / "cut"
    shutil.copytree(tiny_target_dir, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # header intact, tensors cut short
    code, _, err = generate(capsys, tmp_path, prompts_file, cut)
    assert_bad_input(code, err, str(weights), "truncated", "half-written")


def _mtp_folder(target_dir: Path, out: Path) -> Path:
    from angelspec.models import load_target
    from angelspec.models.mtp import MTPConfig, MTPDraftModel
    from angelspec.models.mtp_io import save_mtp

    target = load_target(target_dir)
    model = MTPDraftModel(MTPConfig.for_target(target.config, num_depths=1), target.embed_tokens, target.lm_head)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return save_mtp(model, out)


def _block_folder(target_dir: Path, out: Path) -> Path:
    from angelspec.models import load_target
    from angelspec.models.block.config import BlockDrafterConfig
    from angelspec.models.block.drafter import BlockDrafter
    from angelspec.models.block.io import save_block_drafter

    target = load_target(target_dir)
    cfg = BlockDrafterConfig.for_target(target.config, mask_token_id=1, block_size=4, num_draft_layers=1,
                                        target_layer_ids=(0, 1), conditioning="dfly", head="hidden")
    model = BlockDrafter(cfg, target.embed_tokens, target.lm_head)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return save_block_drafter(model, out)


@pytest.mark.parametrize(("make", "key"), [(_mtp_folder, "mtp_config"), (_block_folder, "block_drafter_config")])
def test_drafter_weights_must_match_their_config(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 prompts_file: Path, tiny_target_dir: Path, make, key: str) -> None:
    folder = make(tiny_target_dir, tmp_path / "drafter")
    raw = json.loads((folder / "config.json").read_text())
    intermediate = raw[key]["intermediate_size"]
    raw[key]["intermediate_size"] = intermediate * 2
    (folder / "config.json").write_text(json.dumps(raw))
    code, _, err = generate(capsys, tmp_path, prompts_file, tiny_target_dir, "--drafter", folder)
    assert_bad_input(code, err, str(folder), "has shape", f"but {key} implies", "different models")
    raw[key]["intermediate_size"] = 10**9  # terabytes: refused before the drafter is built
    (folder / "config.json").write_text(json.dumps(raw))
    code, _, err = generate(capsys, tmp_path, prompts_file, tiny_target_dir, "--drafter", folder)
    assert_bad_input(code, err, str(folder), f"{key} implies", "GB", "weights hold only", "does not describe")
    raw[key]["intermediate_size"] = intermediate
    (folder / "config.json").write_text(json.dumps(raw))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code, _, err = generate(capsys, tmp_path, prompts_file, tiny_target_dir, "--drafter", folder)
    assert_bad_input(code, err, str(weights), "truncated")


# ----- angelspec train: --data and seq_len -----


def _train(capsys: pytest.CaptureFixture[str], target: Path, data: Path, out: Path, *extra: object
           ) -> tuple[int, str, str]:
    return run(capsys, "train", "--drafter", "mtp", "--target", target, "--data", data, "--out", out,
               "--preset", "tiny_debug", "--quiet", *extra)


@pytest.mark.parametrize("content", ["", "\n\n", "{not json\n", '["a list"]\n', '{"prompt": "hi"}\n'])
def test_train_on_data_that_is_not_conversations(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 tiny_target_dir: Path, content: str) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    code, _, err = _train(capsys, tiny_target_dir, data, tmp_path / "out")
    assert_bad_input(code, err, str(data), '{"messages": [', "assistant", "angelspec rollout --prompts FILE --out FILE")
    assert not (tmp_path / "out").exists()


def test_train_on_the_shipped_prompt_file(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          tiny_target_dir: Path) -> None:
    """Prompt-only lines (no assistant turns) have nothing to train on: say which command makes conversations."""
    from angelspec import assets

    prompts = Path(assets.__file__).parent / "prompts" / "train.jsonl"
    for kind in ("mtp", "draft-lm"):
        code, _, err = run(capsys, "train", "--drafter", kind, "--target", tiny_target_dir, "--data", prompts,
                           "--out", tmp_path / kind, "--preset", "tiny_debug", "--quiet")
        assert_bad_input(code, err, str(prompts), "assistant", "angelspec rollout --prompts FILE --out FILE")
    conversations = tmp_path / "no_assistant.jsonl"
    conversations.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code, _, err = _train(capsys, tiny_target_dir, conversations, tmp_path / "out")
    assert_bad_input(code, err, "none of its 1 conversations has an assistant turn", "angelspec rollout")


def test_train_seq_len_beyond_the_target_context(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 tiny_target_dir: Path) -> None:
    from conftest import TINY_CONTEXT, write_conversations

    data = write_conversations(tmp_path / "conv.jsonl", 4, seed=1)
    code, _, err = _train(capsys, tiny_target_dir, data, tmp_path / "out", "seq_len=100000")
    assert_bad_input(code, err, "seq_len=100000", f"context ({TINY_CONTEXT} tokens", "max_position_embeddings",
                     f"seq_len={TINY_CONTEXT} or less")
    assert not (tmp_path / "out").exists()


def test_train_that_cannot_fit_in_memory_is_refused_before_it_starts(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path, tiny_target_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose teacher logits alone exceed the machine's memory is refused in one line (it was OOM-killed
    without a word); a batch that fits is not."""
    from conftest import write_conversations

    from angelspec.models.hf_io import read_config
    from angelspec.train import runs

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(runs, "available_memory_bytes", lambda: 1 << 30)  # a 1 GiB machine
    data = write_conversations(tmp_path / "conv.jsonl", 4, seed=1)
    code, _, err = _train(capsys, tiny_target_dir, data, tmp_path / "out", "batch_size=100000", "seq_len=64")
    assert_bad_input(code, err, "batch_size=100000 x seq_len=64", "GiB per step", "1.0 GiB available",
                     "lower batch_size or seq_len")
    assert not (tmp_path / "out").exists()
    cfg = read_config(tiny_target_dir)
    assert runs.step_memory_floor(2, 64, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) < 1 << 20
    code, _, err = _train(capsys, tiny_target_dir, data, tmp_path / "out", "steps=1", "seq_len=64")
    assert code == 0, err


# ----- angelspec train --resume on a damaged checkpoint -----


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path) -> tuple[Path, Path]:
    """A tiny MTP run with a checkpoint (data, out folder), copied by each test before it damages it."""
    from conftest import write_conversations

    base = tmp_path_factory.mktemp("stopped")
    data = write_conversations(base / "conv.jsonl", 20, seed=1)
    assert main(["train", "--drafter", "mtp", "--target", str(tiny_target_dir), "--data", str(data), "--out",
                 str(base / "out"), "--preset", "tiny_debug", "--quiet"]) == 0
    assert (base / "out" / "training" / "checkpoint" / "trainer_state.json").is_file()
    return data, base / "out"


@pytest.mark.parametrize("damage", ["model.safetensors", "optimizer.pt", "trainer_state.json", "trainer_state.step"])
def test_resume_from_a_damaged_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                                          stopped_run: tuple[Path, Path], damage: str) -> None:
    data, done = stopped_run
    out = tmp_path / "out"
    shutil.copytree(done, out)
    ckpt = out / "training" / "checkpoint"
    name = damage.partition(".step")[0] + (".json" if damage.endswith(".step") else "")
    file = ckpt / name
    if damage == "trainer_state.step":
        state = json.loads(file.read_text())
        state["step"] = "three"
        file.write_text(json.dumps(state))
    else:
        file.write_bytes(file.read_bytes()[: len(file.read_bytes()) // 2])
    code, _, err = _train(capsys, tiny_target_dir, data, out, "--resume", "steps=4")
    assert_bad_input(code, err, "cannot resume", str(file), "--force")


def test_line_separators_inside_json_strings_are_not_line_ends(tmp_path: Path) -> None:
    """U+2028 / U+2029 / U+0085 inside a string are legal JSON and appear raw in real rollouts (json.dumps with
    ensure_ascii=False): the data check must split JSONL at newlines only."""
    from angelspec.train.data import check_conversations

    data = tmp_path / "conv.jsonl"
    turns = [{"role": "user", "content": "a\u2028b\u2029c\x85d"}, {"role": "assistant", "content": "ok\u2028fine"}]
    data.write_text(json.dumps({"messages": turns}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert check_conversations(data) == 1


def test_library_errors_name_the_setting_and_the_cli_its_flag(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    """A bad field of a typed setting: the library's message names the field, the command line's the flag."""
    from angelspec.errors import SettingError
    from angelspec.train.config import Parallelism
    from angelspec.train.runs import TrainSettings, train_drafter

    with pytest.raises(SettingError, match=r"^sp 2: sequence parallelism trains .*not draft-lm; drop sp$") as info:
        train_drafter("draft-lm", tmp_path / "data.jsonl", tmp_path / "out", TrainSettings(parallel=Parallelism(sp=2)))
    assert info.value.settings == ("sp", "sp")
    code = main(["train", "--drafter", "draft-lm", "--data", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "o"),
                 "--sp", "2"])
    assert_bad_input(code, capsys.readouterr().err, "--sp 2: sequence parallelism trains", "drop --sp")
