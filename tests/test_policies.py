"""Depth-policy specs (spec/policies.py): parsing, errors that list the valid forms, the objects they build,
the cost table they load or profile, and `--policy` on `angelspec generate` / `angelspec eval`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from angelspec.cli import main
from angelspec.decoding.drafters.ngram import NGramDrafter
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.policies.base import ConfidenceThreshold, FixedDepth
from angelspec.decoding.policies.budget import LinearCost
from angelspec.decoding.policies.costmodel import CostTable
from angelspec.decoding.policies.dcut import DCut
from angelspec.decoding.policies.factory import POLICY_FORMS, PolicyError, cost_batch_sizes, make_policy, parse_policy
from angelspec.decoding.policies.gate import AutoDepth
from angelspec.decoding.policies.scheduler import PrefixScheduler, ProductionScheduler
from angelspec.eval.cost_profile import load_or_profile
from angelspec.models import load_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path):
    return load_target(tiny_target_dir)


def test_parse_valid_forms() -> None:
    assert parse_policy("full").kind == "full" and not parse_policy("full").needs_cost_model
    assert parse_policy("fixed:0").arg == 0 and parse_policy("fixed:3").arg == 3
    assert parse_policy("threshold:0.4").arg == pytest.approx(0.4)
    assert parse_policy("dcut").arg is None and parse_policy("dcut").needs_cost_model
    d = parse_policy("dcut:0.5")
    assert d.arg == 0.5 and not d.needs_cost_model
    assert parse_policy("alg1").arg is None and parse_policy("alg1:0.05").arg == pytest.approx(0.05)
    assert parse_policy("alg1").needs_cost_model and parse_policy("production").needs_cost_model
    assert parse_policy(" DCut ").kind == "dcut"  # case and surrounding spaces do not matter
    bounded = parse_policy("dcut:max-loss=0.03")
    assert bounded.max_loss == pytest.approx(0.03) and bounded.arg is None and bounded.needs_cost_model
    assert parse_policy("auto").arg is None and parse_policy("auto:slack=0.1").arg == pytest.approx(0.1)
    assert parse_policy("auto:slack=none").arg == math.inf and parse_policy("auto: Slack=0").arg == 0.0


@pytest.mark.parametrize("spec", ["", "fulll", "fixed", "fixed:-1", "fixed:2.5", "threshold", "threshold:1.5",
                                  "threshold:nan", "dcut:0.3", "dcut:x", "dcut:", "dcut:max-loss=1",
                                  "dcut:max-loss=x", "alg1:1", "alg1:-0.1",
                                  "production:2", "full:1", "auto:0.1", "auto:slack", "auto:slack=-1",
                                  "auto:slack=x", "auto:slack=inf", "auto:depth=3"])
def test_parse_errors_list_the_valid_forms(spec: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(spec)
    assert POLICY_FORMS in str(info.value) and isinstance(info.value, ValueError)
    assert type(info.value).__module__.startswith("angelspec")  # the CLI shows it as one line


def test_cost_batch_sizes() -> None:
    assert cost_batch_sizes(1) == (1,) and cost_batch_sizes(8) == (1, 2, 4, 8)
    assert cost_batch_sizes(6) == (1, 2, 4, 6)
    with pytest.raises(PolicyError):
        cost_batch_sizes(0)


def test_make_policy_objects(target, tmp_path: Path) -> None:
    drafter = NGramDrafter()
    kw = dict(target=target, drafter=drafter, num_draft_tokens=3, log=None)
    assert make_policy("full", **kw) == FixedDepth()
    assert make_policy("fixed:2", **kw) == FixedDepth(2)
    assert make_policy("threshold:0.3", **kw) == ConfidenceThreshold(0.3)
    fixed_ratio = make_policy("dcut:0.25", **kw)
    assert isinstance(fixed_ratio, DCut) and fixed_ratio.ratios == (0.25,) and isinstance(fixed_ratio.cost, LinearCost)
    with pytest.raises(PolicyError, match="K=3"):
        make_policy("fixed:4", **kw)
    # AR: only `full` (= the engine's default, None) makes sense.
    assert make_policy("full", target=target, drafter=None, num_draft_tokens=3) is None
    with pytest.raises(PolicyError, match="no drafter"):
        make_policy("dcut:0.5", target=target, drafter=None, num_draft_tokens=3)


def test_cost_policies_load_or_profile_the_table(target, tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    lines: list[str] = []
    kw = dict(target=target, drafter=NGramDrafter(), num_draft_tokens=2, cost_table_path=path, batch_sizes=(1, 2),
              cost_source=load_or_profile, log=lines.append)
    dcut = make_policy("dcut", **kw)
    assert isinstance(dcut, DCut) and isinstance(dcut.cost, CostTable) and dcut.cost.batch_sizes == (1, 2)
    assert path.is_file() and any("profiled" in x for x in lines)
    lines.clear()
    alg1 = make_policy("alg1:0.01", **kw)  # same key: the cached table is loaded, not re-profiled
    assert isinstance(alg1, PrefixScheduler) and alg1.eps == pytest.approx(0.01)
    assert any("loaded" in x for x in lines) and not any("profiled" in x for x in lines)
    prod = make_policy("production", **kw)
    assert isinstance(prod, ProductionScheduler) and isinstance(prod.cost, CostTable)
    auto = make_policy("auto", **kw)  # the serving setting: its gate bounds each request's wait on others' drafts
    assert isinstance(auto, AutoDepth) and auto.make_gate(2, lookup=True).latency_slack == 0.05
    assert make_policy("auto:slack=0.2", **kw).make_gate(2, lookup=True).latency_slack == pytest.approx(0.2)
    assert make_policy("auto:slack=none", **kw).make_gate(2, lookup=True).latency_slack is None
    lines.clear()
    make_policy("dcut", **{**kw, "batch_sizes": (1, 2, 3)})  # a batch size the table lacks: re-profiled
    assert any("profiled" in x and "not measured" in x for x in lines)


@pytest.mark.parametrize("spec", ["full", "fixed:1", "threshold:0.2", "dcut:0.5", "dcut", "alg1", "production"])
def test_every_policy_is_lossless_at_t0(target, tmp_path: Path, spec: str) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, target.config.vocab_size, (6,), generator=g).tolist()
    prompts = [base * 3, base[:3] * 4, base[::-1] * 2]  # repetitive: the n-gram drafter gets accepted
    requests = [Request(p, max_new_tokens=10, stop_ids=()) for p in prompts]
    ar = SpecEngine(target, config=EngineConfig(max_batch_size=2)).generate(requests)
    policy = make_policy(spec, target=target, drafter=NGramDrafter(), num_draft_tokens=3,
                         cost_table_path=tmp_path / "c.json", batch_sizes=(1, 2), cost_source=load_or_profile, log=None)
    spec_out = SpecEngine(target, NGramDrafter(), EngineConfig(max_batch_size=2, num_draft_tokens=3),
                          depth_policy=policy).generate(requests)
    assert [r.token_ids for r in spec_out] == [r.token_ids for r in ar]


# ----- --policy on the command line --------------------------------------------------------------
@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [("code", "def add(x, y):"), ("math", "What is 7 + 8?"), ("chat", "What does a drafter do?")]
    path.write_text("".join(json.dumps({"prompt": p, "domain": d}) + "\n" for d, p in rows))
    return path


def test_generate_with_policies_matches_full(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             tiny_target_dir: Path, prompts_file: Path) -> None:
    outputs = {}
    for policy in ("full", "dcut:0.5", "threshold:0.5"):
        out = tmp_path / f"{policy.replace(':', '_')}.jsonl"
        code = main(["generate", "--target", str(tiny_target_dir), "--prompts", str(prompts_file), "--out",
                     str(out), "--drafter", "ngram", "--policy", policy, "--max-new-tokens", "6", "--quiet"])
        stdout = capsys.readouterr().out
        assert code == 0 and ("policy" in stdout) == (policy != "full")
        outputs[policy] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert outputs["dcut:0.5"] == outputs["full"] == outputs["threshold:0.5"]


def test_eval_with_a_cost_policy(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                                 prompts_file: Path) -> None:
    table = tmp_path / "costs.json"
    report = tmp_path / "eval.json"
    code = main(["eval", "--target", str(tiny_target_dir), "--prompts", str(prompts_file), "--drafter", "ngram",
                 "--policy", "dcut", "--cost-table", str(table), "--max-new-tokens", "5", "--batch-size", "2",
                 "--json", str(report), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert table.is_file() and "policy dcut" in out and "lossless: yes" in out
    assert json.loads(report.read_text())["policy"] == "dcut"


@pytest.mark.parametrize("args, needle", [
    (["--drafter", "ngram", "--policy", "dcut:0.3"], "valid forms"),
    (["--drafter", "none", "--policy", "dcut"], "--drafter is none"),
    (["--drafter", "ngram", "--policy", "fixed:9", "--num-draft-tokens", "2"], "K=2"),
])
def test_bad_policy_is_one_error_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_dir: Path,
                                      prompts_file: Path, args: list[str], needle: str) -> None:
    code = main(["generate", "--target", str(tiny_target_dir), "--prompts", str(prompts_file), "--out",
                 str(tmp_path / "o.jsonl"), "--quiet", *args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
