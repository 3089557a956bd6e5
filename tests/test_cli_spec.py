"""Speculative decoding from the command line: `--drafter` forms and errors, `eval` (report, JSON, lossless
check), `train --drafter`, key=value overrides, and the demo with a draft LM, all on the tiny target."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import synthetic_sentences

from angelspec.cli import main
from angelspec.decoding.drafters.draft_lm import DraftLMDrafter
from angelspec.decoding.drafters.ngram import NGramDrafter
from angelspec.decoding.loading import resolve_drafter
from angelspec.errors import UsageError
from angelspec.eval import speculative
from angelspec.models import load_target
from angelspec.train.draft_lm import DraftLMTrainConfig, draft_lm_tiny_debug, train_draft_lm
from angelspec.train.overrides import parse_overrides, with_overrides

DOMAIN_PROMPTS = [("code", "def add(x, y):"), ("code", "Write a function that merges two lists."),
                  ("math", "Tom has 3 apples and buys 4 more. How many?"), ("math", "What is 7 + 8?"),
                  ("chat", "The cache stores a list of tokens."), ("chat", "What does a drafter do?")]


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("angelspec: error: "), err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


@pytest.fixture(scope="module")
def conversations(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "conv.jsonl"
    lines = list(synthetic_sentences(40, seed=3))
    with open(path, "w") as f:
        for q, a in zip(lines[::2], lines[1::2], strict=True):
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                    + "\n")
    return path


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, conversations: Path) -> Path:
    out = tmp_path_factory.mktemp("draft") / "draft_lm"
    train_draft_lm(tiny_target_dir, conversations, out, config=draft_lm_tiny_debug(), progress=False,
                   log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path):
    return load_target(tiny_target_dir)


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "domain": d}) + "\n" for d, p in DOMAIN_PROMPTS))
    return path


def copy_with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# ----- --drafter forms ---------------------------------------------------------------------------
def test_resolve_drafter_forms(target, tiny_target_dir: Path, draft_dir: Path) -> None:
    assert resolve_drafter(None, target, tiny_target_dir) is None
    assert resolve_drafter("none", target, tiny_target_dir) is None
    ngram = resolve_drafter("ngram", target, tiny_target_dir)
    assert isinstance(ngram, NGramDrafter) and ngram.max_ngram == 3
    assert resolve_drafter("ngram:5", target, tiny_target_dir).max_ngram == 5
    for spec in (f"draft-lm:{draft_dir}", str(draft_dir)):  # explicit kind, or read from config.json
        drafter = resolve_drafter(spec, target, tiny_target_dir)
        assert isinstance(drafter, DraftLMDrafter)
        assert drafter.model.embed_tokens.weight.dtype == torch.float32  # the target's dtype by default
    assert resolve_drafter(str(draft_dir), target, tiny_target_dir, torch.float64).model.embed_tokens.weight.dtype \
        == torch.float64


def test_plain_hf_causal_lm_loads_as_draft_lm(target, tiny_target_dir: Path) -> None:
    """A folder without an "angelspec" entry is any HF causal LM; `draft-lm:DIR` says to use it as a draft model."""
    assert isinstance(resolve_drafter(f"draft-lm:{tiny_target_dir}", target, tiny_target_dir), DraftLMDrafter)


@pytest.mark.parametrize(
    ("make_spec", "needles"),
    [
        (lambda tmp, d, t: "bogus", ["unknown drafter 'bogus'", "ngram:N", "draft-lm:DIR"]),
        (lambda tmp, d, t: "eagle9:/x", ["'eagle9' is not a drafter kind", "draft-lm:DIR"]),
        (lambda tmp, d, t: "ngram:0", ["positive integer"]),
        (lambda tmp, d, t: "ngram:x", ["positive integer", "'x'"]),
        (lambda tmp, d, t: "draft-lm", ["needs the folder", "draft-lm:DIR"]),
        (lambda tmp, d, t: f"draft-lm:{tmp / 'missing'}", ["does not exist", "draft-lm:DIR"]),
        (lambda tmp, d, t: str(d / "config.json"), ["is a file, not a folder"]),
        (lambda tmp, d, t: str(tmp), ["not a drafter folder (no config.json)", "draft-lm:DIR"]),
        (lambda tmp, d, t: str(t), ["not an AngelSpec drafter folder", "as a draft model, pass draft-lm:"]),
        (lambda tmp, d, t: str(copy_with_config(d, tmp / "x", angelspec={"drafter": "eagle9"})),
         ["'eagle9' drafter", "cannot load", "draft-lm"]),
        (lambda tmp, d, t: f"ngram:{d}", ["positive integer"]),
    ],
)
def test_resolve_drafter_errors(target, tiny_target_dir: Path, draft_dir: Path, tmp_path: Path, make_spec,
                                needles: list[str]) -> None:
    spec = make_spec(tmp_path, draft_dir, tiny_target_dir)
    with pytest.raises(UsageError) as info:
        resolve_drafter(spec, target, tiny_target_dir)
    for needle in needles:
        assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_invalid_drafter_json_is_a_clear_error(target, tiny_target_dir: Path, draft_dir: Path,
                                               tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(draft_dir, broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        resolve_drafter(str(broken), target, tiny_target_dir)


def test_drafter_for_another_target_fails_before_decoding(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                          tiny_target_dir: Path, draft_dir: Path,
                                                          prompts_file: Path) -> None:
    raw = json.loads((draft_dir / "config.json").read_text())
    other = copy_with_config(draft_dir, tmp_path / "other",
                             angelspec={**raw["angelspec"], "target_fingerprint": "0123456789abcdef"})
    for command in (["eval", "--json", tmp_path / "e.json"], ["generate", "--out", tmp_path / "o.jsonl"]):
        code, out, err = run(capsys, *command, "--prompts", prompts_file, "--target", tiny_target_dir,
                             "--drafter", other)
        one_error_line(code, err, str(other), "does not fit the target", "0123456789abcdef")
        assert "tokens/s" not in out
    assert not (tmp_path / "e.json").exists() and not (tmp_path / "o.jsonl").exists()


def test_generate_with_drafters_matches_ar(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          tiny_target_dir: Path, draft_dir: Path, prompts_file: Path) -> None:
    def tokens(drafter: str, *extra: object) -> list[list[int]]:
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.jsonl"
        code, stdout, err = run(capsys, "generate", "--prompts", prompts_file, "--out", out, "--target",
                                tiny_target_dir, "--max-new-tokens", 12, "--drafter", drafter, "--quiet", *extra)
        assert code == 0, err
        return [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]

    ar = tokens("none")
    assert tokens("ngram", "--num-draft-tokens", 2) == ar
    assert tokens(str(draft_dir), "--num-draft-tokens", 3) == ar
    code, _, err = run(capsys, "generate", "--prompts", prompts_file, "--out", tmp_path / "x.jsonl",
                       "--num-draft-tokens", 0)
    one_error_line(code, err, "--num-draft-tokens", "at least 1")


# ----- eval --------------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["ngram", "draft_dir"])
def test_eval_report_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                              draft_dir: Path, prompts_file: Path, drafter: str) -> None:
    spec = str(draft_dir) if drafter == "draft_dir" else drafter
    out = tmp_path / "reports" / "eval.json"
    code, stdout, err = run(capsys, "eval", "--target", tiny_target_dir, "--drafter", spec, "--prompts",
                            prompts_file, "--max-new-tokens", 12, "--num-draft-tokens", 3, "--batch-size", 2,
                            "--json", out)
    assert code == 0, err
    for needle in ("MAL", "p_1..p_3", "histogram", "a=3", "time split", "tok/s", "speed-up",
                   "lossless: yes (6/6 identical to AR)", f"wrote {out}"):
        assert needle in stdout, needle
    rows = {line.split()[0] for line in stdout.splitlines() if line.strip()}
    assert {"code", "math", "chat", "all"} <= rows
    assert "100%" in err  # progress bars go to stderr, results to stdout

    report = json.loads(out.read_text())
    assert report["drafter"] == spec and report["target"] == str(tiny_target_dir)
    assert report["settings"] == {"max_new_tokens": 12, "batch_size": 2, "num_draft_tokens": 3, "temperature": 0.0,
                                  "top_k": 0, "top_p": 1.0, "seed": 0, "warmup_tokens": 16, "compile": False,
                                  "spec_gate": False}
    assert report["lossless"] == {"checked": True, "ok": True, "identical": 6, "total": 6, "mismatches": [],
                                  "near_ties": 0, "near_tie_rtol": 1e-3}  # the fp32 target's near-tie tolerance
    assert list(report["domains"]) == ["code", "math", "chat"]
    for block in [report["overall"], *report["domains"].values()]:
        assert block["speedup"] > 0 and block["identical"] == block["prompts"]
        spec_m, ar_m = block["spec"], block["ar"]
        assert spec_m["output_tokens"] == ar_m["output_tokens"] > 0
        assert len(spec_m["acceptance"]) == 3 and len(spec_m["accept_hist"]) == 4
        assert 1.0 <= spec_m["mean_accepted_length"] <= 4.0
        assert ar_m["mean_accepted_length"] == 1.0 and ar_m["num_draft_tokens"] == 0
        assert set(spec_m["seconds"]) == {"prefill", "draft", "select", "verify", "commit"}
    assert report["overall"]["prompts"] == sum(d["prompts"] for d in report["domains"].values()) == 6


def test_eval_compile_flag_compiles_both_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             tiny_target_dir: Path, prompts_file: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`eval --compile` builds the AR and the speculative engine with compile=True and records it in the JSON
    (the engines here run eager: compiled decoding's equality with AR is tested in the engine tests)."""
    seen = []
    engine_cls = speculative.SpecEngine

    def spy(target, drafter=None, config=None, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append((drafter is None, config.compile))
        return engine_cls(target, drafter, replace(config, compile=False), **kw)

    monkeypatch.setattr(speculative, "SpecEngine", spy)
    out = tmp_path / "eval.json"
    code, stdout, err = run(capsys, "eval", "--target", tiny_target_dir, "--drafter", "ngram", "--prompts",
                            prompts_file, "--max-new-tokens", 6, "--compile", "--json", out, "--quiet")
    assert code == 0, err
    assert "lossless: yes" in stdout
    assert seen == [(True, True), (False, True)]  # AR, then speculative
    assert json.loads(out.read_text())["settings"]["compile"] is True


def test_eval_json_is_not_overwritten_without_force(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                    tiny_target_dir: Path, prompts_file: Path) -> None:
    out = tmp_path / "eval.json"
    out.write_text("keep me")
    args = ["eval", "--target", tiny_target_dir, "--drafter", "ngram", "--prompts", prompts_file,
            "--max-new-tokens", 4, "--limit", 1, "--json", out, "--quiet"]
    code, _, err = run(capsys, *args)
    one_error_line(code, err, "--json", "already exists", "--force")
    assert out.read_text() == "keep me"
    code, _, err = run(capsys, *args, "--force")
    assert code == 0, err
    assert json.loads(out.read_text())["prompts"] == 3  # --limit 1: one per domain


def test_eval_sampled_without_domains(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                      tiny_target_dir: Path) -> None:
    """T>0: no token-for-token check (outputs agree in distribution only); no "domain" keys: one group."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for _, p in DOMAIN_PROMPTS))
    out = tmp_path / "e.json"
    code, stdout, err = run(capsys, "eval", "--target", tiny_target_dir, "--drafter", "ngram:2", "--prompts",
                            prompts, "--temperature", 0.8, "--top-p", 0.9, "--seed", 3, "--limit", 4,
                            "--max-new-tokens", 8, "--json", out, "--quiet")
    assert code == 0, err
    assert "lossless: not checked at T>0" in stdout and "T=0.8" in stdout
    report = json.loads(out.read_text())
    assert list(report["domains"]) == ["all"] and report["prompts"] == 4
    assert report["lossless"]["checked"] is False and report["lossless"]["ok"] is None
    assert report["settings"]["seed"] == 3


def test_eval_reports_a_lossless_failure_loudly(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                tiny_target_dir: Path, prompts_file: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine bug that changes one greedy token must surface: exit 1, a banner on stderr, details in JSON."""
    real = speculative.run_decoding

    def corrupted(target, prompts, settings, drafter=None, **kw):
        result = real(target, prompts, settings, drafter, **kw)
        if drafter is not None:
            result.outputs[2][0] = (result.outputs[2][0] + 1) % target.config.vocab_size
        return result

    monkeypatch.setattr(speculative, "run_decoding", corrupted)
    out = tmp_path / "e.json"
    code, stdout, err = run(capsys, "eval", "--target", tiny_target_dir, "--drafter", "ngram", "--prompts",
                            prompts_file, "--max-new-tokens", 6, "--json", out, "--quiet")
    assert code == 1
    assert "lossless: NO: 1/6 outputs differ from AR" in stdout
    assert "LOSSLESS CHECK FAILED" in err and "line 3 (math): first difference at completion token 0" in err
    report = json.loads(out.read_text())
    assert report["lossless"]["ok"] is False and report["lossless"]["identical"] == 5
    assert report["lossless"]["mismatches"][0]["line"] == 3
    assert report["domains"]["math"]["identical"] == 1 and report["domains"]["code"]["identical"] == 2


def test_eval_runs_every_drafter_given_against_one_ar_run(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                          tiny_target_dir: Path, prompts_file: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`--drafter A --drafter B` evaluates both (argparse would otherwise keep only the last), AR decoded once."""
    real, decoded = speculative.run_decoding, []

    def counting(target, prompts, settings, drafter=None, **kw):
        decoded.append(kw.get("desc"))
        return real(target, prompts, settings, drafter, **kw)

    monkeypatch.setattr(speculative, "run_decoding", counting)
    out = tmp_path / "e.json"
    code, stdout, err = run(capsys, "eval", "--target", tiny_target_dir, "--drafter", "ngram", "--drafter", "ngram:2",
                            "--prompts", prompts_file, "--max-new-tokens", 6, "--json", out, "--quiet")
    assert code == 0, err
    assert decoded == ["AR", "ngram", "ngram:2"]
    assert "drafter ngram:" in stdout and "drafter ngram:2:" in stdout
    assert stdout.count("lossless: yes (6/6 identical to AR)") == 2
    table = stdout[stdout.index("every drafter against the same AR run:"):]
    assert "ngram:2" in table and "identical to AR (6/6)" in table
    report = json.loads(out.read_text())
    assert [r["drafter"] for r in report["runs"]] == ["ngram", "ngram:2"]
    assert all(r["lossless"]["ok"] for r in report["runs"]) and "target" in report


def test_eval_of_several_drafters_names_the_one_that_is_not_lossless(capsys: pytest.CaptureFixture[str],
                                                                      tiny_target_dir: Path, prompts_file: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = speculative.run_decoding

    def corrupted(target, prompts, settings, drafter=None, **kw):
        result = real(target, prompts, settings, drafter, **kw)
        if kw.get("desc") == "ngram:2":
            result.outputs[0][0] = (result.outputs[0][0] + 1) % target.config.vocab_size
        return result

    monkeypatch.setattr(speculative, "run_decoding", corrupted)
    code, stdout, err = run(capsys, "eval", "--target", tiny_target_dir, "--drafter", "ngram", "--drafter", "ngram:2",
                            "--prompts", prompts_file, "--max-new-tokens", 4, "--quiet")
    assert code == 1
    assert "lossless: yes (6/6" in stdout and "lossless: NO: 1/6" in stdout
    assert "LOSSLESS CHECK FAILED (ngram:2)" in err and "(ngram)" not in err


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--drafter", "none"], ["nothing to compare", "ngram"]),
        (["--drafter", "ngram", "--drafter", "none"], ["nothing to compare"]),
        (["--drafter", "ngram", "--drafter", "ngram:2", "--policy", "dcut", "--cost-table", "c.json"],
         ["--cost-table", "one drafter", "leave it out"]),
        (["--drafter", "ngram", "--num-draft-tokens", "0"], ["--num-draft-tokens", "at least 1"]),
        (["--drafter", "ngram", "--limit", "0"], ["--limit"]),
        (["--drafter", "ngram", "--temperature", "-1"], ["temperature"]),
        (["--drafter", "ngram", "--json", "."], ["--json", "is a directory"]),
    ],
)
def test_eval_bad_options(capsys: pytest.CaptureFixture[str], tiny_target_dir: Path, prompts_file: Path,
                          extra: list[str], needles: list[str]) -> None:
    code, _, err = run(capsys, "eval", "--target", tiny_target_dir, "--prompts", prompts_file, *extra)
    one_error_line(code, err, *needles)


@pytest.mark.parametrize("domain", [3, "", "all"])  # "all" names the aggregate row
def test_eval_bad_domain(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                         domain: object) -> None:
    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt": "a", "domain": "code"}, {"prompt": "b", "domain": domain}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, _, err = run(capsys, "eval", "--target", tiny_target_dir, "--drafter", "ngram", "--prompts", prompts)
    one_error_line(code, err, f"{prompts}:2:", '"domain"')


def test_compare_and_merge_metrics() -> None:
    """The report's arithmetic on hand-made runs: per-domain identity counts, merged histograms, speed-up."""
    from angelspec.decoding.metrics import DecodeMetrics

    settings = speculative.EvalSettings(max_new_tokens=4, num_draft_tokens=2)
    prompts = [speculative.EvalPrompt([1], "a", 1), speculative.EvalPrompt([2], "b", 2),
               speculative.EvalPrompt([3], "b", 3)]

    def metrics(k: int, tokens: int, wall: float, accepted: list[int]) -> DecodeMetrics:
        m = DecodeMetrics(num_draft_tokens=k, output_tokens=tokens, wall_s=wall)
        if k:
            m.record_verify(accepted, [k] * len(accepted), "greedy")
        return m

    ar = speculative.DecodeRun(settings, 3, {"a": metrics(0, 4, 1.0, []), "b": metrics(0, 8, 2.0, [])},
                               [[5, 6], [7, 8], [9]])
    spec = speculative.DecodeRun(settings, 3, {"a": metrics(2, 4, 0.5, [2, 1]), "b": metrics(2, 8, 0.5, [0])},
                                 [[5, 6], [7, 9], [9, 4]])
    report = speculative.compare(ar, spec, prompts, name="x")
    assert [(m.line, m.position, m.ar_token, m.spec_token) for m in report.mismatches] == [(2, 1, 8, 9),
                                                                                           (3, 1, None, 4)]
    assert report.domains["a"].identical == 1 and report.domains["b"].identical == 0
    assert report.overall.spec.accept_hist == [1, 1, 1] and report.overall.speedup == pytest.approx(3.0)
    assert report.domains["a"].speedup == pytest.approx(2.0) and report.lossless is False
    assert "(end)" in report.format() and "WARNING" not in report.format()
    spec.domains["b"].record_step_seconds(verify=0.002)
    spec.domains["b"].record_step_seconds(verify=14.0)  # a step that compiled a graph
    assert spec.domains["b"].slowest_step_seconds() == 14.0
    stalled = speculative.compare(ar, spec, prompts, name="x").format()
    assert "WARNING: one step of the x run took 14.0 s" in stalled and "AR run" not in stalled
    with pytest.raises(speculative.EvalError, match="other settings"):
        speculative.evaluate(None, None, prompts[:2], settings, name="x", baseline=ar)


# ----- train -------------------------------------------------------------------------------------
def test_train_draft_lm_from_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                                     conversations: Path, prompts_file: Path) -> None:
    out = tmp_path / "draft"
    args = ["train", "--drafter", "draft-lm", "--target", tiny_target_dir, "--data", conversations, "--out", out,
            "--preset", "tiny_debug", "--quiet"]
    code, stdout, err = run(capsys, *args, "steps=2", "intermediate_size=32")
    assert code == 0, err
    assert f"draft-lm written to {out}" in stdout and f"--drafter {out}" in stdout
    raw = json.loads((out / "config.json").read_text())
    assert raw["angelspec"]["drafter"] == "draft-lm" and raw["intermediate_size"] == 32
    assert raw["angelspec"]["train_config"]["steps"] == 2
    code, _, err = run(capsys, *args)
    one_error_line(code, err, "--force")
    code, stdout, err = run(capsys, "eval", "--target", tiny_target_dir, "--drafter", out, "--prompts", prompts_file,
                            "--max-new-tokens", 4, "--limit", 1, "--quiet")
    assert code == 0 and "lossless: yes (3/3" in stdout, err


def test_train_mtp_from_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                                conversations: Path, prompts_file: Path) -> None:
    out = tmp_path / "mtp"
    code, stdout, err = run(capsys, "train", "--drafter", "mtp", "--target", tiny_target_dir, "--data", conversations,
                            "--out", out, "--preset", "tiny_debug", "--quiet", "steps=2")
    assert code == 0, err
    assert f"mtp written to {out}" in stdout
    assert json.loads((out / "config.json").read_text())["angelspec"]["drafter"] == "mtp"
    code, stdout, err = run(capsys, "eval", "--target", tiny_target_dir, "--drafter", out, "--prompts", prompts_file,
                            "--max-new-tokens", 4, "--limit", 1, "--quiet")
    assert code == 0 and "lossless: yes (3/3" in stdout, err


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--drafter", "medusa"], ["cannot train drafter 'medusa'", "trained today are draft-lm, mtp, eagle3"]),
        (["--drafter", "dspark", "block_size=1"], ["block_size", ">= 2"]),
        (["--drafter", "dspark", "--head", "hidden"], ["dspark", "Markov-family"]),
        (["--drafter", "mtp", "--head", "markov"], ["--head applies", "dfly"]),
        (["--drafter", "ngram"], ["needs no training"]),
        (["--drafter", "draft-lm", "--preset", "huge"], ["unknown preset", "tiny_debug"]),
        (["--drafter", "draft-lm", "steps"], ["key=value"]),
        (["--drafter", "draft-lm", "hidden_size=abc"], ["hidden_size", "integer or none"]),
        (["--drafter", "draft-lm", "domain_weights=1"], ["domain_weights", "cannot be set"]),
        (["--drafter", "draft-lm", "--max-minutes", "0"], ["--max-minutes"]),
    ],
)
def test_train_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path, conversations: Path,
                             extra: list[str], needles: list[str]) -> None:
    code, _, err = run(capsys, "train", "--data", conversations, "--out", tmp_path / "o", *extra)
    one_error_line(code, err, *needles)
    assert not (tmp_path / "o").exists()


def test_train_missing_data(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path) -> None:
    code, _, err = run(capsys, "train", "--drafter", "draft-lm", "--target", tiny_target_dir, "--data",
                       tmp_path / "nope", "--out", tmp_path / "o")
    one_error_line(code, err, "--data", "does not exist", "<domain>/train.jsonl")


def test_overrides_follow_the_declared_types() -> None:
    cfg = DraftLMTrainConfig()
    assert parse_overrides(["steps=5", " lr = 0.5 ", "steps=6"]) == {"steps": "6", "lr": "0.5"}
    new = with_overrides(cfg, {"hidden_size": "64", "bf16": "yes", "lr": "1e-3", "steps": "7"})
    assert (new.hidden_size, new.bf16, new.lr, new.steps) == (64, True, 1e-3, 7)
    assert with_overrides(new, {"hidden_size": "none", "bf16": "false"}).hidden_size is None
    for bad, match in [({"bf16": "maybe"}, "true or false"), ({"steps": "1.5"}, "integer"),
                       ({"nope": "1"}, "unknown setting 'nope'"), ({"domain_weights": "x"}, "cannot be set")]:
        with pytest.raises(ValueError, match=match):
            with_overrides(cfg, bad)


# ----- demo --------------------------------------------------------------------------------------
def test_demo_with_a_draft_lm(capsys: pytest.CaptureFixture[str], tiny_target_dir: Path, draft_dir: Path,
                              conversations: Path, tmp_path: Path) -> None:
    """The headline table: AR, n-gram, the draft LM, the shipped drafters found in --drafters (here MTP and DFly
    trained for the tiny target; EAGLE-3 and DSpark missing, so skipped with the command that builds them), DFly
    with D-cut, MTP and DFly + D-cut with the speculation gate, and the short DFly training stage; every output
    identical to AR."""
    from angelspec import demo
    from angelspec.train.block import tiny_debug as block_tiny
    from angelspec.train.block import train_dfly
    from angelspec.train.mtp import tiny_debug as mtp_tiny
    from angelspec.train.mtp import train_mtp

    drafters = tmp_path / "drafters"
    quiet = dict(progress=False, log=lambda *_: None)
    train_mtp(tiny_target_dir, conversations, drafters / "mtp", config=mtp_tiny(), **quiet)
    train_dfly(tiny_target_dir, conversations, drafters / "dfly", config=block_tiny(), **quiet)
    assert demo.main(["--target", str(tiny_target_dir), "--draft-lm", str(draft_dir), "--max-new-tokens", "4",
                      "--per-domain", "1", "--train-minutes", "0.05", "--train-prompts", str(conversations),
                      "--work-dir", str(tmp_path / "demo"), "--drafters", str(drafters), "--no-compile"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("AR vs drafters, per domain"):]
    for name in ("AR", "n-gram", "draft-LM", "MTP-3 (shipped)", "DFly (shipped)", "DFly+D-cut (shipped)",
                 "DFly+n-gram lookup (shipped)", "MTP-3+gate (shipped)", "DFly+D-cut+gate (shipped)",
                 "DFly (2-min demo training)"):
        assert name in table
    assert table.count("identical to AR (1/1)") == 27 and "identical to AR (3/3)" in table  # 9 rows x 3 domains
    assert (tmp_path / "demo" / "dfly" / "config.json").is_file()
    skipped = [line for line in out.splitlines() if "skipped" in line and "prompt longer than context" not in line]
    assert {("EAGLE-3" in line) or ("DSpark" in line) or ("eagle3" in line) or ("dspark" in line)
            for line in skipped} == {True}
    assert all("make drafters" in line for line in skipped if "no drafter in" in line)


def test_demo_skips_a_draft_lm_for_another_target(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                  tiny_target_dir: Path, draft_dir: Path) -> None:
    from angelspec import demo

    raw = json.loads((draft_dir / "config.json").read_text())
    other = copy_with_config(draft_dir, tmp_path / "other",
                             angelspec={**raw["angelspec"], "target_fingerprint": "0123456789abcdef"})
    assert demo.main(["--target", str(tiny_target_dir), "--draft-lm", str(other), "--max-new-tokens", "2",
                      "--per-domain", "1", "--train-minutes", "0", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "0123456789abcdef" in out

