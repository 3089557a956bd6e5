"""The README and docs/ as a user reads them: short, free of internal history, every command and flag of the CLI
documented (docs/cli.md), the "Your own model" command sequence run as written on random-weight Qwen3 and Llama
checkpoints built with transformers (tiny settings appended), and the Python example run as written."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300

# Settings appended to each README command so the sequence runs in seconds on a tiny model; the README's own
# arguments stay as written. `--compile` is dropped: compiling is tested elsewhere and costs minutes here.
TINY = {
    "rollout": ["--max-new-tokens", "12", "--batch-size", "4", "--quiet"],
    "train": ["--quiet", "steps=2", "seq_len=64", "batch_size=1", "warmup=1", "ckpt_every=2", "log_every=1"],
    "calibrate": ["--max-new-tokens", "8", "--batch-size", "2", "--quiet"],
    "eval": ["--limit", "1", "--max-new-tokens", "8", "--batch-size", "2", "--quiet"],
    "generate": ["--max-new-tokens", "8", "--batch-size", "2", "--quiet"],
    "export": [],
}
TINY_DRAFTER = {"dfly": ["num_anchors=4"], "eagle3": []}
DROPPED = {"--compile"}


def section(text: str, heading: str) -> str:
    """The text of the `## heading` section of a markdown file."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def code_block(text: str, lang: str) -> str:
    match = re.search(rf"```{lang}\n(.*?)```", text, flags=re.S)
    assert match, f"no ```{lang} block"
    return match.group(1)


def readme_commands() -> tuple[dict[str, str], list[list[str]]]:
    """The variables and the `angelspec` commands of the README's "Your own model" block, in order."""
    variables: dict[str, str] = {}
    commands: list[list[str]] = []
    for raw in code_block(section(README.read_text(encoding="utf-8"), "Your own model"), "bash").splitlines():
        line = raw.split("#", 1)[0].strip() if not raw.lstrip().startswith("angelspec") else raw.strip()
        if not line or line.startswith("#"):
            continue
        assignment = re.fullmatch(r"([A-Z_]+)=(\S+)", line)
        if assignment:
            variables[assignment.group(1)] = assignment.group(2)
            continue
        assert line.startswith("angelspec "), f"unexpected line in the README's command block: {raw!r}"
        commands.append(shlex.split(line)[1:])
    return variables, commands


# ----- the README itself -----


def test_readme_is_short_and_links_what_it_moved_out() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_README_LINES
    for doc in ("docs/cli.md", "docs/performance.md", "docs/results.md", "docs/export.md", "docs/deployment.md",
                "docs/design.md"):
        assert doc in text, doc
    for doc in ("cli.md", "performance.md", "results.md", "export.md", "design.md"):
        assert (DOCS / doc).is_file(), doc
    for heading in ("Two commands", "Your own model", "In Python", "Status"):
        section(text, heading)
    assert "make demo" in text and "make test" in text
    status = section(text, "Status")
    rows = [line for line in status.splitlines() if line.startswith("| ") and not line.startswith("| feature")]
    assert rows and all(len(row) <= 160 for row in rows), "one short line per feature"


HISTORY = [
    (r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", "a commit hash"),
    (r"(?i)\bissues?\s*#?\d+", "an issue number"),
    (r"(?i)\bthe issue'?s?\b", "a reference to an issue"),
    (r"(?i)\bsessions?\b", "a working session"),
    (r"(?i)\bfaster day\b", "a day of the machine's"),
    (r"(?i)\bthis branch\b", "a branch"),
]


@pytest.mark.parametrize("doc", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_no_internal_history_where_a_user_reads(doc: Path) -> None:
    found = []
    for i, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for pattern, what in HISTORY:
            for m in re.finditer(pattern, line):
                found.append(f"{doc.name}:{i}: {what} ({m.group(0)!r})")
    assert not found, "\n".join(found)


def walk_parser(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(command words, its option strings) for every (sub)command of the parser."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:  # a command (not a group of them)
        yield prefix, [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    for action in groups:
        for name, sub in action.choices.items():
            yield from walk_parser(sub, (*prefix, name))


def test_cli_reference_documents_every_command_and_flag() -> None:
    from angelspec.cli import build_parser

    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    missing = []
    for words, options in walk_parser(build_parser()):
        command = "angelspec " + " ".join(words)
        head = re.search(rf"^### `{re.escape(command)}`$", text, flags=re.M)
        if head is None:
            missing.append(f"no '### `{command}`' section")
            continue
        body = text[head.end():]
        nxt = re.search(r"^### ", body, flags=re.M)
        body = body[:nxt.start()] if nxt else body
        missing += [f"{command}: {opt}" for opt in options if not re.search(rf"{re.escape(opt)}(?![\w-])", body)]
    assert not missing, "docs/cli.md is out of step with the parser:\n" + "\n".join(missing)


# ----- the Python example -----


def test_python_example_runs_as_written(monkeypatch) -> None:
    source = code_block(section(README.read_text(encoding="utf-8"), "In Python"), "python")
    monkeypatch.chdir(ROOT)  # its paths are the repository's
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "README.md (In Python)", "exec"), {"__name__": "readme_example"})
    text = out.getvalue()
    assert "def is_even" in text
    mal = float(re.search(r"([\d.]+) tokens per target forward", text).group(1))
    assert mal > 1.0  # the shipped drafter with the lookup in front accepts drafts


# ----- your own model -----


def tiny_hf_target(out: Path, arch: str, layers: int) -> Path:
    """A random-weight Qwen3 or Llama checkpoint written by transformers, with a small byte-level BPE tokenizer and
    chat template beside it (the Llama's tokenizer declares no mask token, as Llama 3's does not)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    from angelspec.data.tokenizer import load_tokenizer, train_tokenizer
    from tests.conftest import synthetic_sentences

    out.mkdir(parents=True)
    train_tokenizer(synthetic_sentences(400), out, vocab_size=320)
    tok = load_tokenizer(out)
    shape = dict(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    if arch == "qwen3":
        config = transformers.Qwen3Config(**shape, tie_word_embeddings=True)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model_cls(config).save_pretrained(out, safe_serialization=True)
    if arch == "llama":  # a plain HF tokenizer folder, with a reserved special token where the mask token was
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            path = out / name
            if path.is_file():
                data = json.loads(path.read_text(encoding="utf-8").replace("<|mask|>", "<|reserved_special_token_0|>"))
                if isinstance(data, dict):
                    data.pop("mask_token", None)
                path.write_text(json.dumps(data), encoding="utf-8")
        assert type(load_tokenizer(out)).__name__ == "HFChatTokenizer" and load_tokenizer(out).mask_token_id is None
    return out


def tiny_prompts(folder: Path) -> Path:
    folder.mkdir(parents=True)
    train = [{"prompt": p} for p in ["Write add(x, y).", "Tom has 3 apples and buys 4 more.", "What does the cache do?",
                                     "def scale(x, y):", "The target reads a list of tokens.", "Count the rows."]]
    held = [{"prompt": "Write count(x).", "domain": "code"}, {"prompt": "Tom has 5 apples.", "domain": "math"},
            {"prompt": "What does a drafter do?", "domain": "chat"}]
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return folder


@pytest.mark.parametrize("arch,layers", [("qwen3", 3), ("llama", 4)])
def test_own_model_sequence_runs_as_written(tmp_path, monkeypatch, capsys, one_thread, arch, layers) -> None:
    from angelspec.cli import main

    variables, commands = readme_commands()
    assert set(variables) == {"MODEL", "PROMPTS"}, variables
    model = tiny_hf_target(tmp_path / "model", arch, layers)
    env = {"MODEL": str(model), "PROMPTS": str(tiny_prompts(tmp_path / "prompts"))}
    assert [c[0] for c in commands][:5] == ["rollout", "train", "calibrate", "eval", "generate"]
    monkeypatch.chdir(tmp_path)  # the README's runs/ paths are relative
    for words in commands:
        argv = [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], w) for w in words if w not in DROPPED]
        argv += TINY[argv[0]]
        if argv[0] == "train":
            argv += TINY_DRAFTER[argv[argv.index("--drafter") + 1]]
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 0, f"angelspec {shlex.join(argv)} exited {code}:\n{err}"
        if argv[0] == "train" and "dfly" in argv:
            report = json.loads((tmp_path / "runs" / "dfly" / "train_report.json").read_text(encoding="utf-8"))
            assert "preset dfly_embedded" in out and report["steps"] == 2
            if arch == "llama":
                assert "mask token: id" in out  # the tokenizer declares none: a free special token is picked
        if argv[0] == "eval":
            assert "lossless: yes" in out and "(K=7)" in out  # DFly drafts its trained depth
    config = json.loads((tmp_path / "runs" / "dfly" / "config.json").read_text(encoding="utf-8"))
    taps = config.get("target_layer_ids") or config.get("angelspec", {}).get("target_layer_ids")
    assert taps is not None and max(taps) < layers  # spread over this target's layers
    assert (tmp_path / "runs" / "out.jsonl").is_file()
    # The vLLM export, for both families (a DFly gets Qwen3 draft layers for a Llama target too, as vLLM builds them).
    assert json.loads((tmp_path / "runs" / "dfly-vllm" / "config.json").read_text())["architectures"] == [
        "AngelSpecDFlyDFlash"]
