"""The serving sweep's vLLM column (`angelspec bench --vllm`, eval/serving/vllm.py) and the sweep options added with
it (`+compile`, `--limit`), without vLLM: a stand-in runner plays vLLM (it decodes with our own engine, so its
outputs are what vLLM's greedy outputs must be), and a fake venv whose python has no vLLM checks the one-line errors.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from angelspec.cli import main
from angelspec.eval.serving import ServingConfig, ServingReport, parse_config
from angelspec.eval.serving.sweep import Contender
from angelspec.eval.serving.vllm import VllmColumn, VllmRunError, VllmSetup
from angelspec.eval.speculative import EvalPrompt

pytestmark = pytest.mark.usefixtures("one_thread")


def test_parse_config_compile_suffix() -> None:
    assert parse_config("AR-c=none+compile") == ServingConfig("AR-c", "none", compile=True)
    for text in ("N=ngram:2@threshold:0.5+gate+compile", "N=ngram:2@threshold:0.5+compile+gate"):
        assert parse_config(text) == ServingConfig("N", "ngram:2", "threshold:0.5", spec_gate=True, compile=True)
    assert parse_config("N=ngram").compile is False


def _contender(spec: str, k: int = 3, **ngram: int) -> Contender:
    from angelspec.decoding.drafters.ngram import NGramDrafter

    config = parse_config(spec)
    drafter = None if config.is_ar else NGramDrafter(**ngram)
    return Contender(config=config, drafter=drafter, policy=None, num_draft_tokens=0 if drafter is None else k,
                     kind="ar" if drafter is None else "ngram")


def test_vllm_setup_matches_ar_and_full_depth_ngram_only() -> None:
    assert _contender("AR=none").vllm_setup() == _contender("ARc=none+compile").vllm_setup() == VllmSetup("ar")
    assert VllmSetup("ar").speculative_config() is None
    ng = _contender("N=ngram:4@full", k=5, max_ngram=4, min_ngram=2).vllm_setup()
    assert _contender("N=ngram:4", k=5).vllm_setup() is None  # no @POLICY: auto, which vLLM does not have
    assert ng is not None and ng.speculative_config() == {"method": "ngram", "num_speculative_tokens": 5,
                                                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert _contender("N=ngram@threshold:0.5").vllm_setup() is None  # vLLM has no depth policy
    assert _contender("N=ngram+gate").vllm_setup() is None
    mtp = _contender("M=ngram")
    mtp.kind = "mtp"
    assert mtp.vllm_setup() is None


class StandIn:
    """Plays vLLM: records each job and answers it with our own AR engine's outputs (what vLLM's greedy outputs must
    be), in `wall_s` seconds; `corrupt` changes one output of n-gram jobs, `fail_at` fails that job."""

    def __init__(self, target: Any, wall_s: float = 0.25, corrupt: bool = True, fail_at: int | None = None) -> None:
        self.target, self.wall_s, self.corrupt, self.fail_at = target, wall_s, corrupt, fail_at
        self.jobs: list[dict[str, Any]] = []

    def __call__(self, job: dict[str, Any]) -> dict[str, Any]:
        from angelspec.decoding.engine import EngineConfig, Request, SpecEngine

        self.jobs.append(job)
        if self.fail_at == len(self.jobs):
            raise VllmRunError("vLLM (ngram at C=2) failed with exit code 1: boom (log: x.log)")
        new = job["max_new_tokens"]
        engine = SpecEngine(self.target, None, EngineConfig(
            max_batch_size=job["concurrency"], max_seq_len=max(map(len, job["prompts"])) + new))
        outputs = [list(r.token_ids) for r in engine.generate(
            [Request(prompt_ids=p, max_new_tokens=new, stop_ids=()) for p in job["prompts"]])]
        spec = job["speculative_config"]
        if spec is not None and self.corrupt:
            outputs[0][-1] += 1
        return {"concurrency": job["concurrency"], "requests": len(outputs), "output_tokens": sum(map(len, outputs)),
                "wall_s": self.wall_s, "engine_s": 3.0, "drafts": 0 if spec is None else 10,
                "accepted_per_pos": [] if spec is None else [6, 3], "outputs": outputs}


def test_sweep_adds_vllm_cells_from_the_same_requests(tiny_target_dir: Path) -> None:
    from angelspec.eval.serving.sweep import build_contenders, run_sweep, workload_requests
    from angelspec.models import load_target

    target = load_target(tiny_target_dir)
    configs = [ServingConfig("AR"), ServingConfig("NG", "ngram:2"), ServingConfig("NG-t", "ngram:2", "threshold:0.5")]
    contenders = build_contenders(target, tiny_target_dir, configs, concurrency=(1, 2), num_draft_tokens=2, log=None)
    workload = [EvalPrompt([5, 6, 7, 8, 9, 5, 6, 7], "code"), EvalPrompt([9, 8, 7, 9, 8, 7], "math"),
                EvalPrompt([4, 4, 5, 4, 4], "chat")]
    stand_in = StandIn(target)
    column = VllmColumn(target_dir=tiny_target_dir, runner=stand_in, info={"version": "stand-in", "python": "x"})
    report = run_sweep(target, contenders, workload, concurrency=(1, 2), max_new_tokens=6, min_requests=3,
                       warmup_tokens=2, log=None, vllm=column)
    # One job per vLLM setup and concurrency (the threshold config has none), each with our point's requests
    assert [(j["speculative_config"] or {}).get("method", "ar") for j in stand_in.jobs] == ["ar", "ar", "ngram",
                                                                                            "ngram"]
    assert [j["concurrency"] for j in stand_in.jobs] == [1, 2, 1, 2]
    for job in stand_in.jobs:
        n = max(4 * job["concurrency"], 3)
        assert job["prompts"] == [r.prompt_ids for r in workload_requests(workload, n, 6)]
        assert job["max_new_tokens"] == 6 and job["warmup_tokens"] == 2 and job["target"] == str(tiny_target_dir)
    assert stand_in.jobs[2]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2,
                                                      "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    for r in report.rows:
        if r.config == "NG-t":
            assert r.vllm_tokens_per_s is None and r.vllm_identical is None
            continue
        assert r.vllm_tokens_per_s == pytest.approx(r.output_tokens / 0.25)
        assert r.vs_vllm == pytest.approx(r.tokens_per_s / r.vllm_tokens_per_s)
        if r.config == "AR":
            assert r.vllm_identical == r.requests and r.vllm_mal is None
        else:  # the stand-in changed one n-gram output
            assert r.vllm_identical == r.requests - 1 and r.vllm_mal == pytest.approx(1.9)
    table = report.format_table().splitlines()
    assert table[0].rstrip(" |").endswith("vLLM = ours")
    assert [line.split("|")[-2].strip() for line in table[2:]] == ["yes", "yes", "NO (1/4 differ)",
                                                                   "NO (1/8 differ)", "-", "-"]  # N = max(4C, 3)
    text = report.format()
    assert "vLLM columns: vLLM stand-in" in text and "FAILED" not in text
    assert report.settings["vllm"]["setups"] == {"AR": "AR", "NG": "ngram K=2 n=1..2"}
    assert report.to_json()["rows"][0]["vllm_identical"] == 4


def test_a_failed_vllm_run_keeps_what_was_measured(tiny_target_dir: Path) -> None:
    """The second vLLM job fails: the first point keeps its vLLM cell, the rest show '-', and the table says why."""
    from angelspec.models import load_target

    stand_in = StandIn(load_target(tiny_target_dir), fail_at=2)
    column = VllmColumn(target_dir=tiny_target_dir, runner=stand_in)
    measured, error = column.measure([VllmSetup("ar")], [(1, [[5, 6, 7]]), (2, [[5, 6, 7], [4, 5]])],
                                     max_new_tokens=3, warmup_tokens=0, log=None)
    assert list(measured) == [(VllmSetup("ar"), 1)] and error is not None and "boom" in error
    bare = ServingReport(settings={}, rows=[])
    assert "vLLM" not in bare.format_table()
    failed = ServingReport(settings={"vllm": {"version": "0.32.0", "error": error}}, rows=[])
    assert f"vLLM column FAILED: {error}" in failed.format()


def test_compiled_configs_warm_up_at_every_point(tiny_target_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled step specialises on a batch of one, so a compiled config is warmed at each point's batch size; an
    eager one once; and its engines compile."""
    from angelspec.eval.serving import sweep

    warmed: list[tuple[str, int]] = []
    monkeypatch.setattr(sweep, "warm_up", lambda target, ct, workload, *, batch, tokens: warmed.append(
        (ct.config.name, batch)))
    monkeypatch.setattr(sweep, "run_point", lambda target, ct, workload, c, **_: (sweep.ServingRow(
        ct.config.name, ct.config.drafter, ct.kind, "full", 0, c, 2, 2, 1.0, 2.0, 2.0, 1.0, 0.0, 2, 0.0, 0.0), [[1]]))
    eager, compiled = _contender("E=none"), _contender("C=none+compile")
    sweep.run_sweep(None, [eager, compiled], [EvalPrompt([1, 2], "code")], concurrency=(1, 12), log=None)  # type: ignore[arg-type]
    assert warmed == [("E", 8), ("C", 1), ("C", 12)]
    from angelspec.models import load_target

    engine, _ = sweep._engine(load_target(tiny_target_dir), compiled, [EvalPrompt([1, 2], "code")], 1, 1, 2)
    assert engine.config.compile is True


def test_limit_takes_the_first_prompts_of_each_domain(tiny_target_dir: Path, tmp_path: Path) -> None:
    from angelspec.data.tokenizer import load_tokenizer
    from angelspec.eval.serving import serving_workload

    path = tmp_path / "p.jsonl"
    rows = [("code", "a"), ("code", "b"), ("math", "c"), ("math", "d"), ("chat", "e")]
    path.write_text("".join(json.dumps({"prompt": p, "domain": d}) + "\n" for d, p in rows))
    tok = load_tokenizer(tiny_target_dir)
    kept = serving_workload(tok, 512, 4, path, limit=1)
    assert [p.domain for p in kept] == ["code", "math", "chat"] and [p.line for p in kept] == [1, 3, 5]
    assert len(serving_workload(tok, 512, 4, path)) == 5


# ----- angelspec bench --vllm: one line when vLLM is not there ----------------------------------------------------
def _bench(tmp_path: Path, target: Path, *extra: str) -> list[str]:
    return ["bench", "--target", str(target), "--out", str(tmp_path / "o"), "--config", "AR=none",
            "--concurrency", "1", "--max-new-tokens", "2", "--quiet", *extra]


@pytest.mark.parametrize("venv", [None, "no-venv"])
def test_bench_vllm_without_its_venv_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 tiny_target_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                 venv: str | None) -> None:
    monkeypatch.chdir(tmp_path)  # bare --vllm looks for ./.venv-vllm
    code = main(_bench(tmp_path, tiny_target_dir, "--vllm", *([] if venv is None else [str(tmp_path / venv)])))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "make vllm-venv" in err and f"no vLLM venv at {tmp_path / venv if venv else '.venv-vllm'}" in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this interpreter can import vLLM")
def test_bench_vllm_venv_that_cannot_import_vllm_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                              tiny_target_dir: Path) -> None:
    """A venv whose python lacks vLLM (here: this interpreter): the child's own one-line reason comes back, before
    the target is loaded; its full output is in --out/vllm.log."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    code = main(_bench(tmp_path, tiny_target_dir, "--vllm", str(tmp_path / "venv")))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "cannot import" in err and "make vllm-venv" in err and "vllm.log" in err
    assert "cannot import" in (tmp_path / "o" / "vllm.log").read_text()


def test_bench_uses_the_vllm_venv_where_it_exists_unless_no_vllm(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path, tiny_target_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import angelspec.eval.serving.vllm as vllm_module

    monkeypatch.chdir(tmp_path)
    opened = []
    monkeypatch.setattr(vllm_module, "open_vllm_column", lambda venv, *a, **k: opened.append(venv) or None)
    args = _bench(tmp_path, tiny_target_dir, "--no-compile", "--force")
    assert main(args) == 0 and opened == []  # no .venv-vllm here: no vLLM column
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").write_text("")
    assert main(args) == 0 and opened == [".venv-vllm"]  # found: the column is on by default
    assert main([*args, "--no-vllm"]) == 0 and opened == [".venv-vllm"]
    assert main([*args, "--no-vllm", "--vllm", "x"]) == 2
    assert "contradict" in capsys.readouterr().err


def test_repeated_points_run_interleaved_and_report_the_median_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """--repeats R: each point's configs run in turn R times, every other round in reverse order (a machine that
    speeds up or slows down through a round favours no config over two rounds), and each row is its median run (with
    every run's tokens/s); a run whose outputs differ from the others' is reported instead, so a lossless failure
    shows."""
    from angelspec.eval.serving import sweep

    order: list[str] = []
    speeds = {"A": iter([30.0, 10.0, 20.0]), "B": iter([5.0, 7.0, 6.0])}
    outputs = {"A": iter([[[1]], [[1]], [[1]]]), "B": iter([[[1]], [[2]], [[1]]])}
    p95 = {"A": iter([1.0, 3.0, 2.0]), "B": iter([1.2, 3.3, 1.0])}

    def point(target, ct, workload, c, **_):
        order.append(ct.config.name)
        tps = next(speeds[ct.config.name])
        return sweep.ServingRow(ct.config.name, ct.config.drafter, ct.kind, "full", 0, c, 1, 1, 1.0, tps, tps, 1.0,
                                0.0, 1, 0.0, 0.0, tpot_p95_s=next(p95[ct.config.name])), next(outputs[ct.config.name])

    monkeypatch.setattr(sweep, "warm_up", lambda *a, **k: None)
    monkeypatch.setattr(sweep, "run_point", point)
    monkeypatch.setattr(sweep, "_near_ties", lambda *a: 0)
    report = sweep.run_sweep(None, [_contender("A=none"), _contender("B=ngram@full")],  # type: ignore[arg-type]
                             [EvalPrompt([1, 2], "code")], concurrency=(1,), log=None, repeats=3)
    assert order == ["A", "B", "B", "A", "A", "B"]
    a, b = report.rows
    assert a.tokens_per_s == 20.0 and a.runs_tokens_per_s == (30.0, 10.0, 20.0)
    assert b.tokens_per_s == 7.0 and b.identical == 0  # the run that differed from AR's outputs
    # the speed-up pairs the runs of a round (5/30, 7/10, 6/20): their median, not the medians' ratio (7/20)
    assert b.runs_speedup == pytest.approx((5 / 30, 0.7, 0.3)) and b.speedup == pytest.approx(0.3)
    assert "0.30x (0.17-0.70)" in report.format_table()
    # so does the p95 TPOT against AR's (1.2/1, 3.3/3, 1/2): the median 1.1, where the rows' own runs give 3.3/2
    assert b.runs_tpot_p95_s == (1.2, 3.3, 1.0) and b.tpot_p95_vs_ar == pytest.approx(1.1)
    with pytest.raises(sweep.ServingError, match="repeats"):
        sweep.run_sweep(None, [_contender("A=none")], [EvalPrompt([1], "code")], repeats=0)  # type: ignore[arg-type]
