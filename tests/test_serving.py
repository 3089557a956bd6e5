"""The closed-loop serving sweep (eval/serving/), `angelspec bench`, benchmarks/serving.py and the demo's
serving stage, on the tiny target with the n-gram drafter (no training needed)."""

from __future__ import annotations

import builtins
import json
import subprocess
import sys
from pathlib import Path

import pytest

from angelspec.cli import main
from angelspec.decoding.policies.factory import PolicyError
from angelspec.eval.serving import (
    ServingConfig,
    ServingError,
    ServingReport,
    ServingRow,
    check_configs,
    interleave_domains,
    parse_concurrency,
    parse_config,
)
from angelspec.eval.speculative import EvalPrompt

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [("code", "def add(x, y):"), ("code", "def scale(x):"), ("math", "What is 7 + 8?"),
            ("chat", "What does a drafter do?"), ("math", "Tom has 3 apples and buys 4 more.")]
    path.write_text("".join(json.dumps({"prompt": p, "domain": d}) + "\n" for d, p in rows))
    return path


# ----- parsing -------------------------------------------------------------------------------------------
def test_parse_config_forms() -> None:
    assert parse_config("AR=none") == ServingConfig("AR", "none", "full")
    assert parse_config("DFly+D-cut=dfly:/x/y@dcut") == ServingConfig("DFly+D-cut", "dfly:/x/y", "dcut")
    assert parse_config(" T = ngram:2 @ threshold:0.5 ") == ServingConfig("T", "ngram:2", "threshold:0.5")
    for bad in ("AR", "=none", "AR=", "X=@dcut"):
        with pytest.raises(ServingError, match="NAME=SPEC"):
            parse_config(bad)
    with pytest.raises(PolicyError, match="valid forms"):
        parse_config("X=ngram@dcut:0.3")


def test_a_drafter_config_without_a_policy_runs_auto_and_full_stays_available() -> None:
    assert parse_config("DFly=dfly:/x/y") == ServingConfig("DFly", "dfly:/x/y", "auto")
    assert parse_config("DFly=dfly:/x/y+compile") == ServingConfig("DFly", "dfly:/x/y", "auto", compile=True)
    assert parse_config("DFly-full=dfly:/x/y@full") == ServingConfig("DFly-full", "dfly:/x/y", "full")
    assert parse_config("AR=none+compile") == ServingConfig("AR", "none", "full", compile=True)


def test_latency_percentiles_of_a_point() -> None:
    from angelspec.decoding.engine import Result
    from angelspec.eval.serving.base import percentile
    from angelspec.eval.serving.sweep import latency_percentiles

    assert percentile([], 50) == 0.0 and percentile([3.0], 95) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile(list(map(float, range(101))), 95) == 95.0
    # 5 tokens in 0.5 s after a 0.1 s first token: 0.1 s per token after it; one single-token request has no TPOT.
    results = [Result(i, [1] * 5, "length", 5, 3, latency_s=0.1 + 0.4 * (i + 1), first_token_s=0.1) for i in range(4)]
    results.append(Result(9, [1], "length", 1, 3, latency_s=0.2, first_token_s=0.2))
    got = latency_percentiles(results)
    assert got["tpot_p50_s"] == pytest.approx(0.25) and got["tpot_p95_s"] == pytest.approx(0.385)
    assert got["ttft_p50_s"] == pytest.approx(0.1) and got["ttft_p95_s"] == pytest.approx(0.18)


def test_parse_concurrency_and_configs() -> None:
    assert parse_concurrency("4, 1,2") == (1, 2, 4)
    for bad, needle in (("1,x", "not an integer"), ("0,2", "not a usable"), ("2,2", "twice"), ("", "not an integer")):
        with pytest.raises(ServingError, match=needle):
            parse_concurrency(bad)
    with pytest.raises(ServingError, match="used twice"):
        check_configs([ServingConfig("A"), ServingConfig("A", "ngram")])
    with pytest.raises(ServingError, match="policy must be full"):
        check_configs([ServingConfig("A", "none", "dcut")])
    with pytest.raises(ServingError, match="at least once"):
        check_configs([])


def test_interleave_domains() -> None:
    ps = [EvalPrompt([1], "code"), EvalPrompt([2], "code"), EvalPrompt([3], "math"), EvalPrompt([4], "chat")]
    assert [p.ids[0] for p in interleave_domains(ps)] == [1, 3, 4, 2]


# ----- report logic on synthetic rows -------------------------------------------------------------------
def _row(config: str, kind: str, policy: str, c: int, tps: float, mal: float, exec_s: float, sample_s: float,
         drafter: str = "d") -> ServingRow:
    return ServingRow(config=config, drafter="none" if kind == "ar" else drafter, kind=kind, policy=policy,
                      num_draft_tokens=0 if kind == "ar" else 7, concurrency=c, requests=2 * c, output_tokens=100,
                      wall_s=1.0, tokens_per_s=tps, per_user_tokens_per_s=tps / c, mal=mal, mean_depth=1.0, steps=10,
                      exec_s_per_step=exec_s, sample_s_per_step=sample_s)


def _report(dcut_tps: float, dcut_mal: float) -> ServingReport:
    rows = []
    for c in (1, 64):
        rows += [_row("AR", "ar", "full", c, 100, 1.0, 0.010, 0.0),
                 _row("MTP", "mtp", "full", c, 150, 2.5, 0.020, 0.010, drafter="m"),
                 _row("DFly", "dfly", "full", c, 200, 3.0, 0.040, 0.005),
                 _row("DFly+D-cut", "dfly", "dcut", c, dcut_tps, dcut_mal, 0.030, 0.005)]
    return ServingReport(settings={"max_new_tokens": 8, "min_requests": 4}, rows=rows)


def test_goal_line_met_and_not_met() -> None:
    met = _report(dcut_tps=221, dcut_mal=2.95)  # +10.5%, 1.7% MAL loss
    g = met.goal()
    assert g is not None and g.dcut == "DFly+D-cut" and g.full == "DFly" and g.concurrency == 64 and g.met
    assert "MET" in met.goal_line() and "+10.5%" in met.goal_line() and "C=64" in met.goal_line()
    assert "NOT met" in _report(dcut_tps=240, dcut_mal=2.8).goal_line()  # MAL loss 6.7%
    assert "NOT met" in _report(dcut_tps=210, dcut_mal=3.0).goal_line()  # +5% only
    no_pair = ServingReport(settings={}, rows=[r for r in met.rows if r.config != "DFly"])
    assert "not evaluated" in no_pair.goal_line()


def test_the_auto_line_compares_auto_with_ar_and_the_best_other_config() -> None:
    from dataclasses import replace

    report = _report(221, 2.95)
    report.rows += [replace(_row("DFly auto", "dfly", "auto", c, tps, 2.0, 0.02, 0.005), speedup=tps / 100,
                            tpot_p95_vs_ar=0.9) for c, tps in ((1, 190), (64, 110))]
    (line,) = report.auto_lines()
    assert line.startswith("auto (DFly auto;")
    assert "C=1 1.90x AR, 0.86x DFly+D-cut, p95 TPOT 0.90x AR's" in line and "C=64 1.10x AR, 0.50x DFly+D-cut" in line
    assert report.to_json()["auto"] == [line] and line in report.format()
    assert _report(221, 2.95).auto_lines() == []
    # with --repeats, against the best other config too: the median of the rounds' ratios (190/95, 200/400, 180/230),
    # not the rows' 190/221
    paired = ServingReport(settings={}, rows=[replace(r, runs_tokens_per_s=runs) for r, runs in (
        (report.row("DFly+D-cut", 1), (95.0, 400.0, 230.0)), (report.row("DFly auto", 1), (190.0, 200.0, 180.0)))])
    assert "C=1 1.90x AR, 0.78x DFly+D-cut" in paired.auto_lines()[0]
    # auto with its latency slack named is the serving setting too (a line of its own, not a config to beat)
    slack = ServingReport(settings={}, rows=[replace(r, policy="auto:slack=none") if r.config == "DFly auto" else r
                                             for r in report.rows])
    assert slack.auto_lines() == [line]


def test_a_point_with_a_stalled_step_is_flagged(tmp_path: Path) -> None:
    """A step of seconds (a graph compiled mid-run) makes a point's throughput meaningless: the table says so."""
    from dataclasses import replace

    report = _report(221, 2.95)
    assert "WARNING" not in report.format()
    rows = [replace(r, slowest_step_s=12.3) if r.config == "MTP" and r.concurrency == 64 else r for r in report.rows]
    stalled = ServingReport(settings=report.settings, rows=rows)
    text = stalled.format()
    assert text.count("WARNING") == 1 and "MTP C=64: one step took 12.3 s" in text and "not representative" in text
    stalled.write(tmp_path)
    assert "MTP C=64: one step took 12.3 s" in (tmp_path / "results.md").read_text()


def test_breakeven_eq25_uses_the_mtp_reference() -> None:
    be = _report(221, 2.95).breakeven()
    assert be is not None and be.reference == "MTP" and "MTP" in be.why
    # C_BE = 3 (T_exec + T_sample) / (T_exec,ref + T_sample,ref) = 3 * 0.045 / 0.030
    assert be.values["DFly"][64] == pytest.approx(4.5) and be.values["MTP"][1] == pytest.approx(3.0)
    assert be.measured_ref["DFly"][1] == pytest.approx(2.5 * 0.045 / 0.030)
    assert "AR" not in be.values
    text = _report(221, 2.95).format_breakeven()
    assert "reference 'MTP'" in text and "4.50 / 3.00" in text and "Avg." in text
    rows = [r for r in _report(221, 2.95).rows if r.kind != "mtp"]
    fallback = ServingReport(settings={}, rows=rows).breakeven()
    assert fallback is not None and fallback.reference == "DFly" and "no MTP" in fallback.why


def test_step_seconds_medians_ignore_one_outlier_step() -> None:
    """Eq. 25's T_exec and T_sample are medians over steps (the report's T-tilde): one step 100x slower than the
    others does not move them, and the drafter's on_commit is part of the step's drafting time."""
    from angelspec.decoding.metrics import DecodeMetrics
    from angelspec.eval.serving.sweep import EXEC_PHASES, SAMPLE_PHASES

    m = DecodeMetrics(num_draft_tokens=2)
    for i in range(5):
        huge = 100.0 if i == 3 else 1.0
        m.record_step_seconds(draft=0.002 * huge, select=0.001, verify=0.010 * huge, commit=0.003, on_commit=0.002)
    assert m.median_step_seconds(EXEC_PHASES) == pytest.approx(0.010)
    assert m.median_step_seconds(SAMPLE_PHASES) == pytest.approx(0.005)  # draft 2 + select 1 + on_commit 2 ms
    assert m.seconds["verify"] == pytest.approx(0.010 * 104) and m.seconds["commit"] == pytest.approx(0.015)
    assert DecodeMetrics().median_step_seconds(SAMPLE_PHASES) == 0.0
    rows = [_row("MTP", "mtp", "full", 1, 100, 2.5, 0.020, 0.010),
            _row("X", "dfly", "full", 1, 100, 3.0, m.median_step_seconds(EXEC_PHASES),
                 m.median_step_seconds(SAMPLE_PHASES))]
    be = ServingReport(settings={}, rows=rows).breakeven()
    assert be is not None and be.values["X"][1] == pytest.approx(3 * 0.015 / 0.030)  # the mean would give 16.3


def _ngram_point(target: object, name: str, *, slow_propose: tuple[int, float] = (0, 0.0),
                 on_commit_s: float = 0.0) -> ServingRow:
    """`run_point` at concurrency 1 for an n-gram drafter whose `slow_propose[0]`-th propose sleeps `slow_propose[1]`
    seconds and whose every on_commit sleeps `on_commit_s` seconds."""
    import time

    from angelspec.decoding.drafters.ngram import NGramDrafter
    from angelspec.eval.serving.sweep import Contender, run_point

    drafter = NGramDrafter()
    propose, on_commit, calls = drafter.propose, drafter.on_commit, [0]

    def timed_propose(state: object) -> object:
        calls[0] += 1
        time.sleep(slow_propose[1] if calls[0] == slow_propose[0] else 0.0)
        return propose(state)

    def timed_on_commit(commit: object) -> None:
        time.sleep(on_commit_s)
        on_commit(commit)

    drafter.propose, drafter.on_commit = timed_propose, timed_on_commit  # type: ignore[method-assign]
    contender = Contender(config=ServingConfig(name, "ngram"), drafter=drafter, policy=None, num_draft_tokens=2,
                          kind="ngram")
    workload = [EvalPrompt([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], "code")]
    row, _ = run_point(target, contender, workload, 1, max_new_tokens=12, min_requests=2)  # type: ignore[arg-type]
    assert row.steps >= 5  # one stalled step is not the median
    return row


def test_sweep_step_costs_are_medians_and_count_the_drafters_on_commit(tiny_target_dir: Path) -> None:
    """Through the real engine: one propose that stalls for half a second leaves the point's T_sample at a typical
    step's (a mean would add 0.5 s / steps), and a drafter whose on_commit takes 50 ms per step pays it in
    T_sample, which moves its break-even committed length far above the reference's 3."""
    from angelspec.eval.serving import REFERENCE_COMMIT, compute_breakeven
    from angelspec.models import load_target

    target = load_target(tiny_target_dir)
    ref = _ngram_point(target, "NG")
    stalled = _ngram_point(target, "NG-stall", slow_propose=(2, 0.5))
    assert stalled.sample_s_per_step < 0.25 / stalled.steps, stalled  # the mean would be >= 0.5 s / steps
    slow = _ngram_point(target, "NG-slow-commit", on_commit_s=0.05)
    assert slow.sample_s_per_step >= 0.05, slow
    be = compute_breakeven([ref, slow], reference="NG")
    assert be is not None and be.values["NG"][1] == pytest.approx(REFERENCE_COMMIT)
    assert be.values["NG-slow-commit"][1] >= REFERENCE_COMMIT * (slow.exec_s_per_step + 0.05) / ref.step_s
    assert be.values["NG-slow-commit"][1] > 2 * REFERENCE_COMMIT, (ref, slow)


def test_table_json_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = _report(221, 2.95)
    table = report.format_table()
    assert table.startswith("| config") and table.count("\n") == 1 + len(report.rows)
    obj = report.to_json()
    assert obj["goal"]["met"] and obj["breakeven"]["reference"] == "MTP" and len(obj["rows"]) == 8
    paths, note = report.write(tmp_path / "out", breakeven=True)
    assert note is None and {p.name for p in paths} == {"results.json", "results.md", "serving.png", "phases.png",
                                                        "latency.png"}
    assert "break-even" in (tmp_path / "out" / "results.md").read_text()
    assert (tmp_path / "out" / "serving.png").read_bytes()[:4] == b"\x89PNG"
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    paths, note = report.write(tmp_path / "bare")
    assert note is not None and "pip install 'angelspec[bench]'" in note and len(note.splitlines()) == 1
    assert {p.name for p in paths} == {"results.json", "results.md"}


# ----- angelspec bench ------------------------------------------------------------------------------------
def test_bench_cli_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                              prompts_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the dcut cost table goes to ./.cache/angelspec-costs
    out = tmp_path / "bench"
    code = main(["bench", "--target", str(tiny_target_dir), "--prompts", str(prompts_file), "--config", "AR=none",
                 "--config", "NG=ngram@full", "--config", "NG+D-cut=ngram@dcut", "--config", "NG-auto=ngram",
                 "--concurrency", "1,2", "--max-new-tokens", "4", "--min-requests", "3", "--num-draft-tokens", "2",
                 "--warmup-tokens", "2", "--no-compile",
                 "--out", str(out), "--breakeven", "--quiet"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "| NG+D-cut" in stdout and "goal: at the highest concurrency" in stdout and "C=2" in stdout
    assert "break-even committed length" in stdout and "no MTP configuration" in stdout
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert len(rows) == 8 and {r["concurrency"] for r in rows} == {1, 2}
    assert all(r["identical"] == r["requests"] for r in rows)  # lossless against AR at T=0
    assert [r["requests"] for r in rows if r["config"] == "AR"] == [4, 8]  # max(4C, 3)
    assert {r["config"]: r["policy"] for r in rows}["NG-auto"] == "auto"  # a drafter without @POLICY: auto
    assert not any(c["compile"] for c in data["settings"]["configs"])  # --no-compile
    for r in rows:  # per-request latency: p50 <= p95, TTFT and TPOT measured, TPOT against the AR run of the point
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"] and 0 < r["tpot_p50_s"] <= r["tpot_p95_s"]
        assert r["tpot_p95_vs_ar"] == pytest.approx(r["tpot_p95_s"] / next(
            a["tpot_p95_s"] for a in rows if a["config"] == "AR" and a["concurrency"] == r["concurrency"]))
    assert "TPOT p50/p95 ms" in stdout and "TTFT p50/p95 ms" in stdout
    assert all(r["output_tokens"] == 4 * r["requests"] for r in rows)  # fixed length, stop tokens ignored
    assert all(r["speedup"] == 1.0 for r in rows if r["config"] == "AR")
    assert data["goal"]["dcut"] == "NG+D-cut" and data["goal"]["full"] == "NG"
    assert (out / "results.md").is_file() and (out / "serving.png").is_file() and (out / "phases.png").is_file()
    assert (out / "latency.png").is_file()
    assert list((tmp_path / ".cache" / "angelspec-costs").glob("*.json"))


@pytest.mark.parametrize("args, needle", [
    (["--config", "A=none", "--config", "A=ngram"], "used twice"),
    (["--config", "A=none", "--concurrency", "1,two"], "not an integer"),
    (["--config", "A=none", "--concurrency", "0"], "not a usable"),
    (["--config", "A=none@dcut"], "policy must be full"),
    (["--config", "A=dfly:/nonexistent/dfly"], "does not exist"),
    (["--config", "A=/nonexistent/drafter"], "does not exist"),
    (["--config", "A"], "NAME=SPEC"),
    (["--config", "A=ngram@dcut:0.3"], "valid forms"),
    (["--config", "A=none", "--repeats", "0"], "--repeats"),
])
def test_bench_bad_input_is_one_error_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                           tiny_target_dir: Path, args: list[str], needle: str) -> None:
    code = main(["bench", "--target", str(tiny_target_dir), "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


# ----- benchmarks/serving.py and the demo stage ------------------------------------------------------------
def test_benchmark_script_skips_missing_drafters(tmp_path: Path, tiny_target_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import serving as script  # benchmarks/serving.py

    args = script.argparse.Namespace(mtp=str(tmp_path / "no-mtp"), dflash=str(tmp_path / "no-dflash"),
                                     dfly=str(tmp_path / "no-dfly"), block_k=None, mtp_k=3, threshold=0.5)
    configs = script.configs_for(args)
    assert [c.name for c in configs] == ["AR"]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--help"], capture_output=True,
                          text=True, check=True)
    assert "--dfly" in proc.stdout


def test_demo_serving_stage_skips_without_drafters(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from angelspec import demo

    assert any(s.run is demo.stage_serving for s in demo.STAGES)
    names = [s.name for s in demo.STAGES]
    # The sweep measures the shipped drafters after their own stage (so its numbers follow the per-domain ones).
    assert names.index(next(n for n in names if n.startswith("serving"))) > names.index(
        next(n for n in names if "shipped drafters" in n))
    facts = demo.stage_serving(demo.DemoState(target=None, work_dir=tmp_path, drafters=tmp_path / "none"))
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and "no drafter in" in facts["serving"]
    assert "make drafters" in facts["serving"]


def test_demo_serving_stage_runs_the_recommended_setting_at_trained_depths(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's sweep: its own small settings, AR beside the shipped drafters at full depth and DFly under auto, every
    drafter at the depth it was trained for (no fixed K), eager."""
    from angelspec import demo
    from angelspec.eval import serving

    seen = {}

    def fake_bench(model, tokenizer, target_dir, configs, settings, **kwargs):
        seen.update(configs=configs, **vars(settings), **kwargs)
        rows = [ServingRow(config=c.name, drafter=c.drafter, kind="ar" if c.is_ar else "dfly", policy=c.policy,
                           num_draft_tokens=0, concurrency=cc, requests=4, output_tokens=8, wall_s=1.0,
                           tokens_per_s=8.0, per_user_tokens_per_s=8.0, mal=1.0, mean_depth=0.0, steps=8,
                           exec_s_per_step=0.1, sample_s_per_step=0.0, speedup=1.0, identical=4)
                for c in configs for cc in demo.SERVING_CONCURRENCY]
        return ServingReport(settings={}, rows=rows)

    monkeypatch.setattr(serving, "bench", fake_bench)
    facts = demo.stage_serving(demo.DemoState(target=None, work_dir=tmp_path))
    assert [(c.name, c.policy) for c in seen["configs"]] == [("AR", "full"), ("MTP", "full"), ("DFly", "full"),
                                                              ("DFly auto", "auto")]
    assert seen["num_draft_tokens"] is None and not seen.get("compile")
    assert seen["max_new_tokens"] <= 32 and seen["concurrency"] == (1, 4, 16)
    assert facts["serving auto"].startswith("auto (DFly auto;") and facts["serving lossless"].startswith("every")
