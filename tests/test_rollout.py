"""Target rollout (train/rollout.py) and decontamination (data/decontam.py), and their commands (cli/data.py), on
the tiny target."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from angelspec.data.tokenizer import load_tokenizer
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.sampling import SamplingParams
from angelspec.models import load_target
from angelspec.train import rollout as rollout_mod
from angelspec.train.rollout import RolloutError, RolloutSettings, rollout, split_response

pytestmark = pytest.mark.usefixtures("one_thread")

SYSTEM = {"role": "system", "content": "You are terse."}
LINES = [
    {"prompt": "Tom has 3 apples and buys 4 more.", "domain": "math", "id": 7},
    {"messages": [SYSTEM, {"role": "user", "content": "def add(x, y):"},
                  {"role": "assistant", "content": "ORIGINAL-A"}, {"role": "user", "content": "The cache returns"},
                  {"role": "assistant", "content": "ORIGINAL-B"}], "domain": "code"},
    {"messages": [{"role": "user", "content": "A drafter accepts"}, {"role": "assistant", "content": "ORIGINAL-C"},
                  {"role": "user", "content": "this loop prints"}]},
    {"prompt": "The tokenizer reads every row."},
    {"prompt": "My function computes the answer."},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def reference_generate(target_dir: Path, messages: list[dict], max_new_tokens: int) -> list[int]:
    """Plain greedy `SpecEngine.generate` on one rendered prompt: the path rollout must agree with."""
    tok = load_tokenizer(target_dir)
    model = load_target(target_dir, dtype=torch.float32)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    engine = SpecEngine(model, config=EngineConfig(max_batch_size=1))
    req = Request(prompt_ids=ids, max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=0.0, seed=0),
                  stop_ids=tuple(tok.eos_token_ids))
    return engine.generate([req])[0].token_ids


def test_schema_multiturn_and_greedy_equals_generate(tiny_target_dir: Path, tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", LINES[:3])
    out = tmp_path / "out.jsonl"
    summary = rollout(tiny_target_dir, prompts, out, RolloutSettings(temperature=0.0, max_new_tokens=6, batch_size=2))
    rows = read_jsonl(out)
    assert len(rows) == 3 and summary.written == 3 and summary.turns == 1 + 2 + 2
    assert rows[0]["domain"] == "math" and rows[0]["id"] == 7 and "prompt" not in rows[0]
    assert [m["role"] for m in rows[1]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in rows[2]["messages"]] == ["user", "assistant", "user", "assistant"]
    for row in rows:
        info = row["rollout"]
        assert set(info) == {"finish_reason", "num_tokens", "turns", "dropped_turns"}
        assert info["num_tokens"] == sum(t["num_tokens"] for t in info["turns"]) > 0
        assert info["finish_reason"] == ("length" if any(t["finish_reason"] == "length" for t in info["turns"])
                                         else "stop")
        assert not any(m["content"].startswith("ORIGINAL") for m in row["messages"])
    assert summary.truncated_turns == sum(t["finish_reason"] == "length" for r in rows for t in r["rollout"]["turns"])

    # Turn by turn: the second response is generated after the target's OWN first response.
    tok = load_tokenizer(tiny_target_dir)
    msgs = rows[1]["messages"]
    first = reference_generate(tiny_target_dir, msgs[:2], 6)
    assert msgs[2] == split_response(first, "stop" if first[-1] in tok.eos_token_ids else "length", tok,
                                     tok.eos_token_ids, False)
    second = reference_generate(tiny_target_dir, msgs[:4], 6)
    assert msgs[4]["content"] == split_response(second, "stop", tok, tok.eos_token_ids, False)["content"]
    assert rows[1]["rollout"]["turns"][1]["num_tokens"] == len(second)
    single = reference_generate(tiny_target_dir, [{"role": "user", "content": LINES[0]["prompt"]}], 6)
    assert rows[0]["messages"][1]["content"] == split_response(single, "stop", tok, tok.eos_token_ids, False)["content"]


def test_resume_after_kill_mid_line_is_byte_identical(tiny_target_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", LINES)
    kw = RolloutSettings(temperature=0.9, top_p=0.95, seed=3, max_new_tokens=5, batch_size=2, chunk_lines=2)
    full = tmp_path / "full.jsonl"
    rollout(tiny_target_dir, prompts, full, kw)

    out = tmp_path / "killed.jsonl"
    real_write = rollout_mod._write_progress
    calls = []

    def dying_write(path: Path, state: dict) -> None:
        calls.append(state["lines_done"])
        if state["lines_done"] == 4:  # the second chunk reached the file, but the kill beats its sidecar
            with open(out, "ab") as f:
                f.write(b'{"messages": [{"role": "user", "cont')  # and a third chunk was half written
            raise KeyboardInterrupt
        real_write(path, state)

    monkeypatch.setattr(rollout_mod, "_write_progress", dying_write)
    with pytest.raises(KeyboardInterrupt):
        rollout(tiny_target_dir, prompts, out, kw)
    monkeypatch.setattr(rollout_mod, "_write_progress", real_write)
    assert out.read_bytes() != full.read_bytes() and not out.read_bytes().endswith(b"\n")

    with pytest.raises(FileExistsError, match="--resume"):
        rollout(tiny_target_dir, prompts, out, kw)
    with pytest.raises(RolloutError, match="settings differ.*seed"):
        rollout(tiny_target_dir, prompts, out, replace(kw, seed=4), resume=True)
    summary = rollout(tiny_target_dir, prompts, out, kw, resume=True)
    assert summary.resumed_at == 2 and summary.written == len(LINES)
    assert out.read_bytes() == full.read_bytes()
    # Resuming a finished run changes nothing.
    rollout(tiny_target_dir, prompts, out, kw, resume=True)
    assert out.read_bytes() == full.read_bytes()


def test_refusals_and_force(tiny_target_dir: Path, tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", LINES[:1])
    out = tmp_path / "out.jsonl"
    out.write_text("not ours\n")
    with pytest.raises(FileExistsError, match="--force"):
        rollout(tiny_target_dir, prompts, out, RolloutSettings(max_new_tokens=2))
    with pytest.raises(RolloutError, match="no progress file"):
        rollout(tiny_target_dir, prompts, out, RolloutSettings(max_new_tokens=2), resume=True)
    summary = rollout(tiny_target_dir, prompts, out, RolloutSettings(max_new_tokens=1), force=True)
    row = read_jsonl(out)[0]
    # One token: either a stop token at once or a response cut by max_new_tokens, kept but flagged.
    assert row["rollout"]["num_tokens"] == 1
    assert summary.truncated_turns == int(row["rollout"]["finish_reason"] == "length")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(RolloutError, match=r"bad.jsonl:1: messages\[0\] is an assistant turn"):
        rollout(tiny_target_dir, bad, tmp_path / "o2.jsonl")


def test_split_response_thinking(tiny_target_dir: Path) -> None:
    tok = load_tokenizer(tiny_target_dir)
    msg = {"role": "assistant", "content": "the answer", "reasoning_content": "three apples"}
    rendered = tok.apply_chat_template([{"role": "user", "content": "q"}, msg], add_generation_prompt=False,
                                       enable_thinking=True)
    head = tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True,
                                   enable_thinking=True)
    generated = rendered[len(head):-1]  # what the target writes: up to and including <|im_end|>, minus "\n"
    assert generated[-1] == tok.im_end_id
    assert split_response(generated, "stop", tok, tok.eos_token_ids, True) == msg
    cut = split_response(generated[:3], "length", tok, tok.eos_token_ids, True)
    assert cut["content"] == "" and "reasoning_content" in cut



def test_split_response_drops_control_tokens_written_mid_answer(tiny_target_dir: Path) -> None:
    """A target may write <think> (or spell a control token out of ordinary pieces) anywhere; the message keeps the
    text around it and stays trainable (encode_conversation refuses control-token strings in a content)."""
    from angelspec.data.chat import encode_conversation

    tok = load_tokenizer(tiny_target_dir)
    think = tok.token_to_id("<think>")
    spelled = tok.encode("a <") + tok.encode("think>b")
    for generated in ([*tok.encode("one"), think, *tok.encode(" two")], spelled):
        for thinking in (False, True):
            msg = split_response(generated, "length", tok, tok.eos_token_ids, thinking)
            assert "<think>" not in msg["content"]
            encode_conversation(tok, [{"role": "user", "content": "q"}, msg], enable_thinking=thinking)
    assert split_response(spelled, "length", tok, tok.eos_token_ids, False)["content"] == "a b"


# ----- decontamination -----


class WordTokenizer:
    """One token per whitespace-separated word: makes "16 shared tokens" exact by construction."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        inv = {i: w for w, i in self.vocab.items()}
        return " ".join(inv[i] for i in ids)


def words(lo: int, hi: int) -> str:
    return " ".join(f"w{i}" for i in range(lo, hi))


def test_decontaminate_drops_exactly_the_16_token_overlaps() -> None:
    from angelspec.data.decontam import decontaminate

    evals = [{"prompt": words(0, 30)}, "an unrelated eval prompt"]
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    train = [
        {"prompt": f"x y {words(5, 21)} z", "domain": "math"},  # 16 shared -> dropped
        {"prompt": f"{words(5, 20)} q {words(21, 30)}", "domain": "math"},  # 15 + 9: near miss, kept
        {"messages": [user("hello"), {"role": "assistant", "content": "a"}, user(words(10, 26))],
         "domain": "chat"},  # second user turn -> dropped
        {"messages": [user("hello"), {"role": "assistant", "content": words(0, 30)}], "domain": "chat"},  # answer
        {"messages": [user(words(0, 8)), {"role": "assistant", "content": "a"}, user(words(8, 16))]},  # split turns
    ]
    kept, report = decontaminate(train, evals, WordTokenizer(), n=16)
    assert kept == [train[1], train[3], train[4]]
    assert [d["index"] for d in report.dropped] == [0, 2]
    assert report.dropped[0]["overlap"] == words(5, 21) and report.dropped[0]["eval_index"] == 0
    assert report.dropped_by_domain == {"math": 1, "chat": 1}
    assert report.total_by_domain == {"math": 2, "chat": 2, "unknown": 1}
    assert "dropped 2/5" in report.format()
    kept15, _ = decontaminate(train, evals, WordTokenizer(), n=15)
    assert train[1] not in kept15


def test_ngram_hashes_match_a_slow_reference() -> None:
    from angelspec.data.decontam import _BASE, ngram_hashes

    rng = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50_000, (200,), generator=rng).tolist()
    n, b = 16, int(_BASE)
    slow = [sum((ids[i + j] + 1) * pow(b, n - 1 - j, 1 << 64) for j in range(n)) % (1 << 64)
            for i in range(len(ids) - n + 1)]
    assert ngram_hashes(ids, n).tolist() == slow
    assert ngram_hashes(ids[:15], n).size == 0


def test_decontam_cli_function(tiny_target_dir: Path, tmp_path: Path) -> None:
    import argparse

    from angelspec.cli.data import add_decontam, cmd_decontam
    from angelspec.data.decontam import report_path

    eval_text = ("Tom has 12 apples and buys 30 more. 12 + 30 = 42. The answer is 42. "
                 "Tom has 7 apples and buys 8 more.")
    ev = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": eval_text}])
    train = write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "Please solve: " + eval_text, "domain": "math"},
        {"prompt": "def add(x, y):\n    return x + y * 3", "domain": "code"},
    ])
    parser = argparse.ArgumentParser()
    add_decontam(parser.add_subparsers(dest="command"))
    out = tmp_path / "clean.jsonl"
    args = parser.parse_args(["decontam", "--train", str(train), "--eval", str(ev), "--out", str(out),
                              "--target", str(tiny_target_dir)])
    assert args.func(args) == 0 and args.func is cmd_decontam
    assert [r["domain"] for r in read_jsonl(out)] == ["code"]
    assert json.loads(report_path(out).read_text())["dropped_by_domain"] == {"math": 1}
    with pytest.raises(FileExistsError, match="--force"):
        args.func(args)


def test_rollout_cli_function(tiny_target_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from angelspec.cli.data import add_rollout, cmd_rollout

    prompts = write_jsonl(tmp_path / "p.jsonl", LINES[:2])
    parser = argparse.ArgumentParser()
    add_rollout(parser.add_subparsers(dest="command"))
    out = tmp_path / "o.jsonl"
    argv = ["rollout", "--target", str(tiny_target_dir), "--prompts", str(prompts), "--out", str(out),
            "--no-think", "--temperature", "0.7", "--top-p", "0.9", "--seed", "1", "--max-new-tokens", "3",
            "--batch-size", "2", "--quiet"]
    args = parser.parse_args(argv)
    assert args.func is cmd_rollout and args.func(args) == 0
    assert "rollout: 2/2 conversations" in capsys.readouterr().out
    assert len(read_jsonl(out)) == 2
    with pytest.raises(RolloutError, match="contradict"):
        cmd_rollout(parser.parse_args([*argv, "--resume", "--force"]))


@pytest.mark.parametrize("think", [False, True])
def test_context_overflow_skips_or_cuts_conversations(tiny_target_dir: Path, tmp_path: Path, think: bool) -> None:
    long = "Tom has three apples. " * 120  # far beyond the tiny target's 256-token context
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": long, "id": "too-long"},
        {"messages": [user("hi"), {"role": "assistant", "content": "x"}, user(long),
                      {"role": "assistant", "content": "y"}, user("bye")], "id": "cut"},
        {"prompt": "The cache returns the answer.", "id": "ok"},
    ])
    out = tmp_path / "out.jsonl"
    summary = rollout(tiny_target_dir, prompts, out, RolloutSettings(enable_thinking=think, max_new_tokens=4))
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == ["cut", "ok"]
    assert summary.skipped_too_long == 1 and summary.dropped_turns == 2 and summary.written == 2
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"]
    assert rows[0]["rollout"]["dropped_turns"] == 2 and len(rows[0]["rollout"]["turns"]) == 1
    tok = load_tokenizer(tiny_target_dir)
    for row in rows:  # every output conversation is trainable data under the same template
        enc = tok.encode_conversation(row["messages"], enable_thinking=think)
        assert sum(enc.loss_mask) > 0


def test_batch_size_and_chunking_do_not_change_the_file(tiny_target_dir: Path, tmp_path: Path) -> None:
    """Why resuming with another --batch-size is allowed: per-request seeds make rows batch-independent."""
    prompts = write_jsonl(tmp_path / "p.jsonl", LINES)
    outs = []
    for bs, chunk in [(1, 2), (4, None)]:
        out = tmp_path / f"o{bs}.jsonl"
        rollout(tiny_target_dir, prompts, out, RolloutSettings(temperature=0.9, seed=5, max_new_tokens=6, batch_size=bs,
                                                               chunk_lines=chunk))
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


# ---------------------------------------------------------------------------------------------------------
# --engine vllm: vLLM is not installed here (it lives in .venv-vllm); `make vllm-check` runs the real one
# ---------------------------------------------------------------------------------------------------------


def test_engine_vllm_without_vllm_fails_in_one_line_naming_the_make_target(
        tiny_target_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from angelspec.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    prompts = write_jsonl(tmp_path / "p.jsonl", LINES[:1])
    out = tmp_path / "o.jsonl"
    code = main(["rollout", "--engine", "vllm", "--target", str(tiny_target_dir), "--prompts", str(prompts),
                 "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--engine vllm needs vLLM" in err and "make vllm-venv" in err
    assert not out.exists() and not out.with_name(out.name + ".progress.json").exists()


class _FakeVllm:
    """A stand-in `vllm` module with the semantics read in vLLM 0.32's source (`v1/core/sched/utils.py check_stop`:
    a stop token ends the request and stays in its output; `max_tokens` caps it), greedy through our engine; it
    checks that `VllmEngine` hands vLLM the request the way our engine runs it."""

    def __init__(self, target_dir: Path) -> None:
        import types

        self.calls: list[dict] = []
        fake = self

        class LLM:
            def __init__(self, **kwargs) -> None:
                fake.calls.append(kwargs)
                self.engine = SpecEngine(load_target(target_dir, dtype=torch.float32),
                                         config=EngineConfig(max_batch_size=kwargs["max_num_seqs"]))

            def generate(self, prompts, params, use_tqdm=False):
                assert all(p.temperature == 0.0 and p.ignore_eos for p in params)
                reqs = [Request(prompt_ids=p["prompt_token_ids"], max_new_tokens=s.max_tokens,
                                sampling=SamplingParams(), stop_ids=tuple(s.stop_token_ids))
                        for p, s in zip(prompts, params, strict=True)]
                done = self.engine.generate(reqs)
                return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=r.token_ids,
                                                                             finish_reason=r.finish_reason)])
                        for r in done]

        self.params: list = []

        def sampling_params(**kwargs):
            fake.params.append(kwargs)
            return types.SimpleNamespace(**kwargs)

        self.module = types.SimpleNamespace(LLM=LLM, SamplingParams=sampling_params)
        self.inputs = types.SimpleNamespace(TokensPrompt=dict)
        self.on_cpu = True
        self.platforms = types.SimpleNamespace(current_platform=types.SimpleNamespace(is_cpu=lambda: fake.on_cpu))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> _FakeVllm:
        import sys

        for name, module in (("vllm", self.module), ("vllm.inputs", self.inputs), ("vllm.platforms", self.platforms)):
            monkeypatch.setitem(sys.modules, name, module)
        return self


def test_engine_vllm_writes_our_greedy_file_and_records_the_engine(tiny_target_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    fake = _FakeVllm(tiny_target_dir)
    for name, module in (("vllm", fake.module), ("vllm.inputs", fake.inputs), ("vllm.platforms", fake.platforms)):
        monkeypatch.setitem(sys.modules, name, module)
    prompts = write_jsonl(tmp_path / "p.jsonl", LINES)
    ours, theirs = tmp_path / "ours.jsonl", tmp_path / "vllm.jsonl"
    rollout(tiny_target_dir, prompts, ours, RolloutSettings(max_new_tokens=12, batch_size=2))
    rollout(tiny_target_dir, prompts, theirs, RolloutSettings(max_new_tokens=12, batch_size=2, engine="vllm"))
    assert theirs.read_bytes() == ours.read_bytes()
    assert fake.calls[0]["dtype"] == "float32" and fake.calls[0]["enforce_eager"] is True
    config = json.loads(theirs.with_name(theirs.name + ".progress.json").read_text())["config"]
    assert config["engine"] == "vllm"
    assert "engine" not in json.loads(ours.with_name(ours.name + ".progress.json").read_text())["config"]
    with pytest.raises(RolloutError, match="engine"):  # a file is continued by the engine that started it
        rollout(tiny_target_dir, prompts, ours, RolloutSettings(max_new_tokens=12, batch_size=2, engine="vllm"),
                resume=True)


def test_vllm_settings_reach_the_llm_constructor_and_default_to_bf16_and_256_sequences_on_a_gpu(
        tiny_target_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`rollout --engine vllm` on a GPU: bf16 by default (vLLM's GPU attention backends take bf16 / fp16), compiled,
    256 sequences; the tensor-parallel size, memory share and context flags arrive as vLLM's `LLM` keywords, and a
    smaller context caps every request's max_tokens."""
    from conftest import run_cli

    fake = _FakeVllm(tiny_target_dir).install(monkeypatch)
    fake.on_cpu = False
    prompts = write_jsonl(tmp_path / "p.jsonl", LINES[:2])
    code, _, err = run_cli(capsys, "rollout", "--engine", "vllm", "--target", tiny_target_dir, "--prompts", prompts,
                           "--out", tmp_path / "a.jsonl", "--max-new-tokens", "12", "--quiet")
    assert code == 0, err
    call = fake.calls[-1]
    assert (call["dtype"], call["max_num_seqs"], call["enforce_eager"], call["tensor_parallel_size"]) == (
        "bfloat16", 256, False, 1)
    assert call["max_model_len"] == load_target(tiny_target_dir).config.max_position_embeddings
    assert "gpu_memory_utilization" not in call  # vLLM's own default
    code, _, err = run_cli(capsys, "rollout", "--engine", "vllm", "--target", tiny_target_dir, "--prompts", prompts,
                           "--out", tmp_path / "b.jsonl", "--max-new-tokens", "200", "--quiet", "--vllm-dtype",
                           "float16", "--tensor-parallel-size", "4", "--gpu-memory-utilization", "0.85",
                           "--max-model-len", "64", "--batch-size", "32")
    assert code == 0, err
    call = fake.calls[-1]
    assert {k: call[k] for k in ("dtype", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len",
                                 "max_num_seqs")} == {"dtype": "float16", "tensor_parallel_size": 4,
                                                      "gpu_memory_utilization": 0.85, "max_model_len": 64,
                                                      "max_num_seqs": 32}
    last = fake.params[-len(LINES[:2]):]
    assert all(0 < p["max_tokens"] < 64 for p in last)  # capped by the 64-token context, not --max-new-tokens 200


def test_vllm_engine_on_cpu_stays_fp32_and_eager(tiny_target_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from angelspec.decoding.vllm_engine import VllmEngine, VllmSettings

    fake = _FakeVllm(tiny_target_dir).install(monkeypatch)
    VllmEngine(tiny_target_dir, max_batch_size=3, settings=VllmSettings(max_model_len=32))
    assert {k: fake.calls[-1][k] for k in ("dtype", "enforce_eager", "max_num_seqs", "max_model_len")} == {
        "dtype": "float32", "enforce_eager": True, "max_num_seqs": 3, "max_model_len": 32}


@pytest.mark.parametrize(("flags", "words"), [
    (["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization", "(0, 1]"]),
    (["--tensor-parallel-size", "0"], ["--tensor-parallel-size", ">= 1"]),
    (["--max-model-len", "100000"], ["--max-model-len 100000", "max_position_embeddings"]),
    (["--batch-size", "0"], ["batch_size", ">= 1"]),
])
def test_bad_vllm_settings_are_one_line_before_vllm_starts(tiny_target_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch, flags, words) -> None:
    from conftest import assert_bad_input, run_cli

    fake = _FakeVllm(tiny_target_dir).install(monkeypatch)
    prompts = write_jsonl(tmp_path / "p.jsonl", LINES[:1])
    code, _, err = run_cli(capsys, "rollout", "--engine", "vllm", "--target", tiny_target_dir, "--prompts", prompts,
                           "--out", tmp_path / "o.jsonl", "--quiet", *flags)
    assert_bad_input(code, err, *words)
    assert not fake.calls and not (tmp_path / "o.jsonl").exists()


def test_vllm_flags_without_the_vllm_engine_are_refused(tiny_target_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import assert_bad_input, run_cli

    prompts = write_jsonl(tmp_path / "p.jsonl", LINES[:1])
    code, _, err = run_cli(capsys, "rollout", "--target", tiny_target_dir, "--prompts", prompts, "--out",
                           tmp_path / "o.jsonl", "--tensor-parallel-size", "2", "--vllm-dtype", "bfloat16")
    assert_bad_input(code, err, "--vllm-dtype, --tensor-parallel-size", "--engine vllm")
