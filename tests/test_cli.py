"""CLI behaviour through `main([...])`: exit codes and one-line error messages for each kind of bad input,
and a happy-path `generate` (plus the demo) on the tiny target from conftest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import assert_bad_input, run_cli

from angelspec import assets
from angelspec.cli import main
from angelspec.data.prompts import PromptFileError, load_prompts
from angelspec.decoding import generate


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    return run_cli(capsys, *args)


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    return write_lines(tmp_path / "prompts.jsonl", json.dumps({"prompt": "def add(x, y):"}))


# ----- parser -------------------------------------------------------------------------------------
def test_help_and_missing_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0 and all(name in out for name in ("generate", "eval", "train", "target"))
    code, _, err = run(capsys)
    assert code == 2 and "COMMAND" in err


# ----- prompts file ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("lines", "needles"),
    [
        ([json.dumps({"prompt": "ok"}), '{"prompt": "unterminated'], [":2:", "malformed JSON"]),
        ([json.dumps({"text": "hi"})], [":1:", '"prompt"', '"messages"', "'text'"]),
        ([json.dumps({"prompt": 3})], [":1:", '"prompt" must be a string', "number"]),
        ([json.dumps({"prompt": "a", "messages": []})], [":1:", "both"]),
        ([json.dumps({"messages": "hi"})], [":1:", '"messages" must be a list']),
        ([json.dumps({"messages": []})], [":1:", "empty list"]),
        ([json.dumps({"messages": [{"role": "robot", "content": "x"}]})], [":1:", "messages[0]", "'robot'"]),
        ([json.dumps({"messages": [{"role": "user", "content": None}]})], [":1:", "content", "null"]),
        ([json.dumps(["prompt"])], [":1:", "JSON object", "array"]),
        (["", "   "], ["is empty"]),
    ],
)
def test_bad_prompt_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, lines: list[str],
                          needles: list[str]) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", *lines)
    code, _, err = run(capsys, "generate", "--prompts", prompts, "--out", tmp_path / "o.jsonl")
    assert_bad_input(code, err, str(prompts), *needles)
    assert not (tmp_path / "o.jsonl").exists()


def test_missing_prompts_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "generate", "--prompts", tmp_path / "nope.jsonl", "--out", tmp_path / "o.jsonl")
    assert_bad_input(code, err, "nope.jsonl", "does not exist")


def test_load_prompts_wraps_prompt_and_keeps_line_numbers(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", json.dumps({"prompt": "hi", "id": 7}), "",
                       json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hello"}]}))
    first, second = load_prompts(path)
    assert first == {"line": 1, "messages": [{"role": "user", "content": "hi"}], "record": {"prompt": "hi", "id": 7}}
    assert second["line"] == 3 and [m["role"] for m in second["messages"]] == ["system", "user"]
    with pytest.raises(PromptFileError):
        load_prompts(write_lines(tmp_path / "empty.jsonl"))


# ----- options -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("option", "needles"),
    [
        (["--temperature", "-0.5"], ["temperature", "-0.5"]),
        (["--top-p", "0"], ["top_p", "(0, 1]"]),
        (["--top-p", "1.5"], ["top_p"]),
        (["--top-k", "-1"], ["top_k"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens", "at least 1"]),
        (["--batch-size", "0"], ["--batch-size"]),
    ],
)
def test_invalid_generation_options(capsys: pytest.CaptureFixture[str], tmp_path: Path, prompts_file: Path,
                                    option: list[str], needles: list[str]) -> None:
    code, _, err = run(capsys, "generate", "--prompts", prompts_file, "--out", tmp_path / "o.jsonl", *option)
    assert_bad_input(code, err, *needles)


def test_existing_output_is_not_overwritten(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            prompts_file: Path) -> None:
    out = write_lines(tmp_path / "o.jsonl", "keep me")
    code, _, err = run(capsys, "generate", "--prompts", prompts_file, "--out", out)
    assert_bad_input(code, err, "already exists", "--force")
    assert out.read_text() == "keep me\n"


def test_bugs_keep_their_traceback(tmp_path: Path, prompts_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only deliberate bad-input errors become one-line messages; anything else must surface."""

    def broken(*_: object) -> None:  # (target folder, placement)
        raise RuntimeError("a genuine bug")

    monkeypatch.setattr(generate, "load_target_and_tokenizer", broken)
    with pytest.raises(RuntimeError, match="genuine bug"):
        main(["generate", "--prompts", str(prompts_file), "--out", str(tmp_path / "o.jsonl"), "--target", "x"])


# ----- target folder -----------------------------------------------------------------------------
def test_missing_target_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path, prompts_file: Path) -> None:
    code, _, err = run(capsys, "generate", "--prompts", prompts_file, "--out", tmp_path / "o.jsonl",
                       "--target", tmp_path / "no-such-model")
    assert_bad_input(code, err, "no-such-model", "does not exist")


def test_embedded_target_not_built(capsys: pytest.CaptureFixture[str], tmp_path: Path, prompts_file: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assets, "DEFAULT_TARGET", tmp_path / "assets" / "target")
    code, _, err = run(capsys, "generate", "--prompts", prompts_file, "--out", tmp_path / "o.jsonl")
    assert_bad_input(code, err, "embedded target is not built yet", "angelspec target build")


def test_half_written_target(capsys: pytest.CaptureFixture[str], tmp_path: Path, prompts_file: Path,
                             tiny_target_dir: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_target_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a copy interrupted part-way
    code, _, err = run(capsys, "generate", "--prompts", prompts_file, "--out", tmp_path / "o.jsonl",
                       "--target", broken)
    assert_bad_input(code, err, str(broken), "half-written")
    weights.unlink()
    code, _, err = run(capsys, "generate", "--prompts", prompts_file, "--out", tmp_path / "o.jsonl",
                       "--target", broken)
    assert_bad_input(code, err, "model.safetensors")


def test_target_without_tokenizer(capsys: pytest.CaptureFixture[str], tmp_path: Path, prompts_file: Path,
                                  tiny_target_dir: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(tiny_target_dir, bare)
    (bare / "tokenizer.json").unlink()
    code, _, err = run(capsys, "generate", "--prompts", prompts_file, "--out", tmp_path / "o.jsonl", "--target", bare)
    assert_bad_input(code, err, "tokenizer", str(bare))


def test_unknown_architecture(capsys: pytest.CaptureFixture[str], tmp_path: Path, prompts_file: Path,
                              tiny_target_dir: Path) -> None:
    other = tmp_path / "gpt2"
    shutil.copytree(tiny_target_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (other / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "generate", "--prompts", prompts_file, "--out", tmp_path / "o.jsonl",
                       "--target", other)
    assert_bad_input(code, err, "unknown architecture", "GPT2LMHeadModel")


def test_prompt_longer_than_context(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                    tiny_target_dir: Path) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", json.dumps({"prompt": "short"}),
                          json.dumps({"prompt": " ".join(f"word{i}" for i in range(400))}))
    code, _, err = run(capsys, "generate", "--prompts", prompts, "--out", tmp_path / "o.jsonl",
                       "--target", tiny_target_dir)
    assert_bad_input(code, err, f"{prompts}:2:", "tokens", "context is 256")


# ----- happy path --------------------------------------------------------------------------------
def test_generate_writes_one_line_per_prompt(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             tiny_target_dir: Path) -> None:
    inputs = [
        {"prompt": "def add(x, y):"},
        {"messages": [{"role": "system", "content": "Answer briefly."},
                      {"role": "user", "content": "Tom has 3 apples. How many?"}]},
        {"prompt": "The cache stores", "id": "row-3"},
    ]
    prompts = write_lines(tmp_path / "p.jsonl", *(json.dumps(r) for r in inputs))
    out = tmp_path / "out" / "o.jsonl"
    code, stdout, err = run(capsys, "generate", "--prompts", prompts, "--out", out, "--target", tiny_target_dir,
                            "--max-new-tokens", 8, "--batch-size", 2)
    assert code == 0, err
    assert "tokens/s" in stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(inputs)
    for given, row in zip(inputs, rows, strict=True):
        assert {k: row[k] for k in given} == given
        assert isinstance(row["completion"], str)
        assert 1 <= len(row["token_ids"]) <= 8 and all(isinstance(t, int) for t in row["token_ids"])
        assert isinstance(row["finish_reason"], str)


def test_seeded_sampling_is_reproducible_and_force_overwrites(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                              tiny_target_dir: Path) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", *(json.dumps({"prompt": p}) for p in ("a", "b")))
    out = tmp_path / "o.jsonl"
    args = ["generate", "--prompts", prompts, "--out", out, "--target", tiny_target_dir, "--max-new-tokens", 6,
            "--temperature", 1.0, "--top-p", 0.9, "--seed", 5, "--quiet"]
    assert run(capsys, *args)[0] == 0
    first = out.read_text()
    assert run(capsys, *args)[0] == 2  # refuses to overwrite
    assert run(capsys, *args, "--force")[0] == 0
    assert out.read_text() == first


# ----- target build (argument checks only; the build itself is tested in test_train_target) -------
@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--preset", "huge"], ["unknown preset", "tiny_debug"]),
        (["steps"], ["key=value"]),
        (["no_such_field=1"], ["no_such_field"]),
        (["steps=many"], ["steps", "int"]),
        (["--max-minutes", "0"], ["--max-minutes"]),
    ],
)
def test_target_build_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: list[str],
                                    needles: list[str]) -> None:
    code, _, err = run(capsys, "target", "build", "--out", tmp_path / "t", "--work-dir", tmp_path / "w", *extra)
    assert_bad_input(code, err, *needles)


def test_target_build_refuses_to_overwrite(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "t"
    out.mkdir()
    (out / "config.json").write_text("{}")
    code, _, err = run(capsys, "target", "build", "--out", out, "--work-dir", tmp_path / "w", "--preset",
                       "tiny_debug")
    assert_bad_input(code, err, "--force")
    assert (out / "config.json").read_text() == "{}"


# ----- outputs that would destroy an input, or that cannot be written ------------------------------
def _command(name: str, target: Path, prompts: Path, out: Path, other: Path) -> list[object]:
    """`name` reading `prompts` and writing `out` (`other`: a second input, decontam's evaluation prompts)."""
    small = ["--target", target, "--max-new-tokens", 2]
    return {"generate": ["generate", "--prompts", prompts, "--out", out, *small, "--quiet"],
            "eval": ["eval", "--drafter", "ngram", "--prompts", prompts, "--json", out, *small, "--quiet"],
            "rollout": ["rollout", "--prompts", prompts, "--out", out, *small, "--quiet"],
            "decontam": ["decontam", "--train", prompts, "--eval", other, "--out", out, "--target", target]}[name]


COMMANDS = ["generate", "eval", "rollout", "decontam"]


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("link", ["same", "symlink", "hardlink", "relative"])
def test_an_output_that_is_an_input_is_refused_even_with_force(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                               tiny_target_dir: Path, prompts_file: Path,
                                                               monkeypatch: pytest.MonkeyPatch, name: str,
                                                               link: str) -> None:
    other = write_lines(tmp_path / "eval.jsonl", json.dumps({"prompt": "What is 7 + 8?"}))
    before = prompts_file.read_text()
    out = {"same": prompts_file, "symlink": tmp_path / "link.jsonl", "hardlink": tmp_path / "hard.jsonl",
           "relative": Path("sub") / ".." / prompts_file.name}[link]
    if link == "symlink":
        out.symlink_to(prompts_file)
    elif link == "hardlink":
        out.hardlink_to(prompts_file)
    elif link == "relative":
        (tmp_path / "sub").mkdir()
        monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *_command(name, tiny_target_dir, prompts_file, out, other), "--force")
    assert_bad_input(code, err, "same file", "input")
    assert prompts_file.read_text() == before
    if name == "decontam":  # every input counts, not only the first
        code, _, err = run(capsys, *_command(name, tiny_target_dir, prompts_file, other, other), "--force")
        assert_bad_input(code, err, "same file", "--eval")


@pytest.mark.parametrize("name", COMMANDS)
def test_an_output_under_a_file_is_refused_before_the_work(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           tiny_target_dir: Path, prompts_file: Path,
                                                           monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    from angelspec.decoding import loading

    def no_model(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the output path was checked")

    import angelspec.models

    monkeypatch.setattr(loading, "load_target_and_tokenizer", no_model)
    monkeypatch.setattr(generate, "load_target_and_tokenizer", no_model)
    monkeypatch.setattr(angelspec.models, "load_target", no_model)
    other = write_lines(tmp_path / "eval.jsonl", json.dumps({"prompt": "What is 7 + 8?"}))
    blocker = write_lines(tmp_path / "results", "a file, not a folder")
    out = blocker / "sub" / "o.jsonl"
    code, _, err = run(capsys, *_command(name, tiny_target_dir, prompts_file, out, other))
    assert_bad_input(code, err, str(blocker), "not a folder")
    assert blocker.read_text() == "a file, not a folder\n"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores folder permissions")
@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("missing", [False, True])
def test_an_output_in_a_read_only_folder_is_refused_before_the_work(capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path, tiny_target_dir: Path,
                                                                    prompts_file: Path, name: str,
                                                                    missing: bool) -> None:
    other = write_lines(tmp_path / "eval.jsonl", json.dumps({"prompt": "What is 7 + 8?"}))
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked / "new" / "o.jsonl" if missing else locked / "o.jsonl"  # a folder to create, or to write in
    locked.chmod(0o555)
    try:
        code, _, err = run(capsys, *_command(name, tiny_target_dir, prompts_file, out, other))
    finally:
        locked.chmod(0o755)
    assert_bad_input(code, err, str(locked), "not writable")
    assert list(locked.iterdir()) == []


# ----- train -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mtp", "draft-lm"])
def test_train_resume_without_a_checkpoint_keeps_the_finished_model(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path, tiny_target_dir: Path,
                                                                      kind: str) -> None:
    """--resume on a folder that holds a model but no checkpoint has nothing to resume: refused before anything is
    written, instead of training from scratch over the model."""
    from conftest import write_conversations

    data = write_conversations(tmp_path / "conv.jsonl", 20, seed=1)
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "config.json").write_text('{"finished": true}')
    (out / "model.safetensors").write_text("trained weights")
    code, _, err = run(capsys, "train", "--drafter", kind, "--target", tiny_target_dir, "--data", data, "--out", out,
                       "--preset", "tiny_debug", "--resume", "--quiet")
    assert_bad_input(code, err, str(out), "no checkpoint", "nothing to resume", "--force")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == '{"finished": true}'
    assert (out / "model.safetensors").read_text() == "trained weights"


def test_train_refusals_come_before_the_eval_server_starts(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           tiny_target_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import write_conversations

    from angelspec.eval import server

    started: list[object] = []
    monkeypatch.setattr(server, "spawn_eval_server", lambda *a, **kw: started.append(a) or server.subprocess.Popen(
        ["true"]))
    data = write_conversations(tmp_path / "conv.jsonl", 20, seed=1)
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "config.json").write_text("{}")
    for extra in (["--resume"], []):  # nothing to resume; a model without --force
        code, _, err = run(capsys, "train", "--drafter", "mtp", "--target", tiny_target_dir, "--data", data, "--out",
                           out, "--preset", "tiny_debug", "--eval-every", "1", "--quiet", *extra)
        assert_bad_input(code, err, "--force")
    assert started == [] and sorted(p.name for p in tmp_path.iterdir()) == ["conv.jsonl", "drafter"]


# ----- demo --------------------------------------------------------------------------------------
def test_demo_on_tiny_target_without_draft_lm(capsys: pytest.CaptureFixture[str], tiny_target_dir: Path,
                                              tmp_path: Path) -> None:
    """No trained draft LM yet: the demo still runs AR and n-gram, and says how to train the draft LM."""
    from angelspec import demo

    args = ["--target", str(tiny_target_dir), "--max-new-tokens", "4", "--per-domain", "2",
            "--draft-lm", str(tmp_path / "no-draft-lm"), "--train-minutes", "0", "--no-compile"]
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    assert "demo report" in out and "tokens/s" in out
    assert all(f"[{domain}]" in out for domain in ("code", "math", "chat"))
    assert "skipped" in out and "angelspec train --drafter draft-lm" in out
    assert "n-gram" in out and "identical to AR (6/6)" in out and "draft-LM" not in out


def test_demo_without_embedded_target(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from angelspec import demo

    monkeypatch.setattr(assets, "DEFAULT_TARGET", tmp_path / "missing")
    assert demo.main([]) == 2
    assert "angelspec target build" in capsys.readouterr().err
