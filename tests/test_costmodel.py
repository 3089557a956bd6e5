"""The start-up cost profiler (eval/cost_profile.py) and its table (decoding/policies/costmodel.py): interpolation of
the table, keys, stale/foreign table detection, step timing through the engine's on_verify hook with a fake clock,
and `angelspec profile`."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from angelspec.cli import main
from angelspec.decoding.drafters.base import DraftState, full_depth_drafting
from angelspec.decoding.drafters.draft_lm import DraftLMDrafter
from angelspec.decoding.drafters.ngram import NGramDrafter
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.policies.budget import LinearCost
from angelspec.decoding.policies.costmodel import (
    CostKey,
    CostSettings,
    CostTable,
    CostTableError,
    StaleCostTableError,
    cost_key,
    default_table_path,
    machine_id,
)
from angelspec.decoding.policies.dcut import DCut
from angelspec.decoding.policies.scheduler import prefix_schedule
from angelspec.eval.cost_profile import SpreadDepth, load_or_profile, profile_costs, token_grid
from angelspec.models import few_rows, load_target
from angelspec.models.attention import set_attention_backend

KEY = CostKey(model="m" * 16, drafter="draft-lm:abc", num_draft_tokens=3, dtype="float32", torch_version="2.x",
              machine="host|cpu|2 cores|1 threads")


def table_from(fn, batch_sizes=(1, 2, 4), k: int = 3, key: CostKey = KEY) -> CostTable:
    """A table 'measured' by a fake cost function on the default grid."""
    return CostTable(key=key, rows={b: tuple((n, fn(b, n)) for n in token_grid(b, k)) for b in batch_sizes})


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path):
    return load_target(tiny_target_dir)


# ----- the table -----------------------------------------------------------------------------------
def test_token_grid() -> None:
    assert token_grid(2, 3) == [2, 4, 6, 8]  # B(d+1), d = 0..K
    assert token_grid(2, 3, [1, 5, 100]) == [2, 5, 8]  # clipped to [B, B(K+1)], both ends always


def test_interpolation_is_exact_for_linear_costs_and_piecewise_linear_otherwise() -> None:
    lin = LinearCost(fixed=0.5, per_token=0.01)
    table = table_from(lin)
    for b in (1, 2, 4):
        for n in range(b, 4 * b + 1):  # between measured points, piecewise-linear = linear
            assert table(b, n) == pytest.approx(lin(b, n))
    assert table(4, 20) == pytest.approx(lin(4, 20))  # linear extrapolation beyond the last point
    # Between measured batch sizes: linear in B at the same tokens per request (u = N / B = 2).
    quad = table_from(lambda b, n: 1.0 + 0.1 * b + 0.001 * n * n)
    assert quad(3, 6) == pytest.approx((quad(2, 4) + quad(4, 8)) / 2)
    assert quad(2, 5) == pytest.approx((quad(2, 4) + quad(2, 6)) / 2)  # piecewise-linear in N
    assert quad(8, 16) == pytest.approx(quad(4, 8))  # beyond the measured B: the nearest row, same u
    assert quad.sps(2, 4) == pytest.approx(1 / quad(2, 4))


def test_extrapolation_never_goes_below_the_cheapest_measurement() -> None:
    table = CostTable(key=KEY, rows={2: ((2, 1.0), (4, 3.0))})
    assert table(2, 0) == 1.0 and table(2, 3) == 2.0 and table(2, 6) == 5.0


def test_table_is_a_cost_model_for_the_budgets() -> None:
    table = table_from(lambda b, n: 1.0 + 0.05 * n)
    conf = torch.tensor([[0.9, 0.8, 0.1], [0.2, 0.1, 0.1]])
    active = torch.tensor([True, True])
    assert prefix_schedule(conf, active, 2, table).tolist() == prefix_schedule(conf, active, 2,
                                                                              LinearCost(1.0, 0.05)).tolist()
    assert DCut(cost=table).cost is table


@pytest.mark.parametrize("rows", [{}, {2: ()}, {2: ((4, 1.0), (2, 2.0))}, {2: ((2, 0.0),)},
                                  {2: ((2, float("nan")),)}])
def test_bad_tables_are_refused(rows) -> None:
    with pytest.raises(CostTableError):
        CostTable(key=KEY, rows=rows)


# ----- keys, save / load, stale tables --------------------------------------------------------------
def test_save_load_round_trip_and_stale_detection(tmp_path: Path) -> None:
    table = table_from(lambda b, n: 1.0 + n)
    path = table.save(tmp_path / "t.json")
    assert CostTable.load(path, KEY) == table
    for change in ({"machine": "other|gpu"}, {"model": "x" * 16}, {"dtype": "bfloat16"}, {"drafter": "mtp"},
                   {"num_draft_tokens": 5}, {"torch_version": "9.9"}):
        with pytest.raises(StaleCostTableError) as info:
            CostTable.load(path, replace(KEY, **change))
        field = next(iter(change))
        assert field in str(info.value) and "re-profile" in str(info.value)
    path.write_text("{broken")
    with pytest.raises(CostTableError, match="not valid JSON"):
        CostTable.load(path)
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CostTableError, match="not an AngelSpec cost table"):
        CostTable.load(path)


def test_keys_name_model_drafter_dtype_and_machine(target) -> None:
    key = cost_key(target, NGramDrafter(), 3)
    assert key.model == target.config.fingerprint() and key.drafter == "ngram" and key.dtype == "float32"
    assert key.torch_version == torch.__version__ and key.machine == machine_id("cpu")
    assert f"{torch.get_num_threads()} threads" in key.machine
    native = few_rows.attention_op() is not None  # "auto" on a CPU: the native attention where it is built
    assert key.kernels == "|".join(p for p in (few_rows.identity(), "attention:native" if native else "") if p)
    set_attention_backend(target, "sdpa")  # another attention, another table
    try:
        assert cost_key(target, NGramDrafter(), 3).kernels == few_rows.identity()
    finally:
        set_attention_backend(target, "auto")
    assert default_table_path(key).name.startswith(key.model)
    assert default_table_path(key) != default_table_path(replace(key, machine="elsewhere"))


def test_a_compiled_engine_has_a_table_of_its_own_and_eager_keys_keep_their_digest(tmp_path: Path) -> None:
    """An eager key serialises without `compiled` (tables written before the field load under the same name); a
    compiled table is another file, and loading it for an eager engine is refused as stale."""
    compiled = replace(KEY, compiled=True)
    assert "compiled" not in KEY.to_json() and compiled.to_json()["compiled"] is True
    assert KEY.digest() != compiled.digest() and default_table_path(KEY) != default_table_path(compiled)
    old_style = {k: v for k, v in vars(KEY).items() if k not in ("compiled", "kernels")}  # written before them
    assert KEY.digest() == hashlib.sha256(json.dumps(old_style, sort_keys=True).encode()).hexdigest()[:12]
    kernel = replace(KEY, kernels="few-rows:0123")  # another CPU product kernel: another table
    assert kernel.to_json()["kernels"] == "few-rows:0123" and kernel.digest() != KEY.digest()
    path = table_from(lambda b, n: 0.001 * n, key=compiled).save(tmp_path / "c.json")
    assert CostTable.load(path, compiled).key.compiled and "compiled" in CostTable.load(path).format()
    with pytest.raises(StaleCostTableError, match="compiled"):
        CostTable.load(path, KEY)


# ----- profiling -------------------------------------------------------------------------------------
def test_spread_depth_keeps_n_positions(target, one_thread) -> None:
    seen = []
    # stop_below=None: the draft LM proposes all K drafts (its early stop would cap the depths, as the profiler
    # knows: profile_costs switches it off with full_depth_drafting).
    engine = SpecEngine(target, DraftLMDrafter(target, stop_below=None),
                        EngineConfig(max_batch_size=3, num_draft_tokens=3),
                        depth_policy=SpreadDepth(8), on_verify=lambda e: seen.append(e.depth.tolist()))
    engine.generate([Request(prompt_ids=[5, 6, 7], max_new_tokens=6, stop_ids=())] * 3)
    assert seen[:2] == [[2, 2, 1]] * 2  # 3 anchors + 5 drafts, the first rows get one more
    assert seen[-1] == [0, 0, 3]  # rows 0 and 1 finished first; the last row alone is capped at K


def test_on_verify_hook_reports_each_step(target) -> None:
    events = []
    engine = SpecEngine(target, NGramDrafter(), EngineConfig(max_batch_size=2, num_draft_tokens=2),
                        on_verify=events.append)
    engine.generate([Request(prompt_ids=[1, 2, 3], max_new_tokens=5, stop_ids=())] * 2)
    assert len(events) == engine.metrics.steps
    for e in events:
        assert e.depth.shape == e.num_accepted.shape == e.active.shape == (2,)
        assert bool((e.num_accepted <= e.depth).all()) and e.proposal.tokens.shape == (2, 2)


def test_profile_with_a_fake_clock_takes_the_median(target, one_thread) -> None:
    ticks = itertools.accumulate(itertools.cycle([1.0, 1.0, 1.0, 50.0]))  # every 4th step an outlier
    table = profile_costs(target, NGramDrafter(), CostSettings(batch_sizes=(1, 2), num_draft_tokens=2, repeats=3,
                                                               warmup=1, machine="fake"), clock=lambda: next(ticks))
    assert table.batch_sizes == (1, 2) and [n for n, _ in table.rows[2]] == [2, 4, 6]
    assert all(c == 1.0 for row in table.rows.values() for _, c in row)  # the median ignores the outlier
    assert table.key.machine == "fake" and table.settings["repeats"] == 3


def test_ngram_drafts_every_row_for_a_profile() -> None:
    """A row whose lookup finds nothing drafts K padding tokens inside `full_depth_drafting` (so a profile cell of
    N positions verifies N) and nothing outside it."""
    drafter = NGramDrafter()
    drafter.allocate(2, 32, device=torch.device("cpu"), slack=0)
    drafter.prefill([0, 1], [[1, 2, 3, 4], [7, 8, 7]], [5, 8], ())  # row 0: 5 never seen before; row 1 matches
    state = DraftState(last_tokens=torch.tensor([5, 8]), seq_lens=torch.tensor([5, 4]),
                       active=torch.tensor([True, True]), active_rows=(0, 1), sampling=None,
                       draft_round=torch.zeros(2, dtype=torch.int64), num_draft_tokens=3, deterministic=True,
                       all_greedy=True, seq_len_bound=5)
    assert drafter.propose(state).lengths.tolist() == [0, 3]
    with full_depth_drafting(drafter):
        padded = drafter.propose(state)
    assert padded.lengths.tolist() == [3, 3] and padded.tokens[0].tolist() == [5, 5, 5]
    assert padded.confidences[0].tolist() == [0.0, 0.0, 0.0] and drafter.draft_every_row is False


def test_a_compiled_profile_is_keyed_compiled(target, tmp_path: Path, one_thread) -> None:
    kw = {"batch_sizes": (1,), "num_draft_tokens": 2, "repeats": 1, "warmup": 1, "machine": "here"}
    table, what = load_or_profile(target, NGramDrafter(), CostSettings(compile=True, **kw), tmp_path / "c.json")
    assert table.key.compiled and what.startswith("profiled")
    _, what = load_or_profile(target, NGramDrafter(), CostSettings(**kw), tmp_path / "c.json")
    assert "stale" in what and "compiled" in what  # the eager engine does not take the compiled table


def test_load_or_profile_reprofiles_stale_tables(target, tmp_path: Path, one_thread) -> None:
    path = tmp_path / "costs.json"
    kw = {"batch_sizes": (1,), "num_draft_tokens": 2, "repeats": 1, "warmup": 0, "machine": "here"}
    table, what = load_or_profile(target, NGramDrafter(), CostSettings(**kw), path)
    assert what.startswith("profiled (no table yet)") and path.exists()
    again, what = load_or_profile(target, NGramDrafter(), CostSettings(**kw), path)
    assert again == table and what == f"loaded {path}"
    foreign = {**kw, "machine": "another machine"}
    with pytest.raises(StaleCostTableError, match="machine"):
        load_or_profile(target, NGramDrafter(), CostSettings(**foreign), path, reprofile=False)
    fresh, what = load_or_profile(target, NGramDrafter(), CostSettings(**foreign), path)
    assert "stale" in what and "machine" in what and fresh.key.machine == "another machine"
    assert CostTable.load(path).key.machine == "another machine"
    _, what = load_or_profile(target, NGramDrafter(), CostSettings(**{**foreign, "batch_sizes": (1, 2)}), path)
    assert "batch sizes [2] not measured" in what


def test_a_policy_can_take_its_cost_table_from_a_stand_in_drafter(target, tmp_path: Path, one_thread) -> None:
    """A drafter that cannot draft the profiler's random prompts (step_cost.py's oracle) gets its budget policy's table
    from a stand-in whose steps cost the same."""
    from angelspec.decoding.policies.factory import make_policy

    class Picky(NGramDrafter):
        def prefill(self, *args, **kwargs):
            raise KeyError("no continuation for this prompt")

    path = tmp_path / "c.json"
    with pytest.raises(KeyError, match="no continuation"):
        make_policy("dcut", target=target, drafter=Picky(), num_draft_tokens=2, cost_table_path=path,
                    batch_sizes=(1,), cost_source=load_or_profile, log=None)
    policy = make_policy("dcut", target=target, drafter=Picky(), num_draft_tokens=2, cost_table_path=path,
                         batch_sizes=(1,), cost_drafter=NGramDrafter(), cost_source=load_or_profile, log=None)
    assert isinstance(policy, DCut) and CostTable.load(path).key.drafter == "ngram"


def test_profile_cli(capsys: pytest.CaptureFixture[str], tiny_target_dir: Path, tmp_path: Path,
                     one_thread) -> None:
    out = tmp_path / "costs.json"
    args = ["profile", "--target", tiny_target_dir, "--drafter", "ngram", "--batch-sizes", "1,2",
            "--num-draft-tokens", 2, "--repeats", 1, "--warmup", 0, "--out", out]
    assert main([str(a) for a in args]) == 0
    stdout = capsys.readouterr().out
    assert "B=2" in stdout and "N=6" in stdout and "profiled (no table yet)" in stdout
    assert CostTable.load(out).batch_sizes == (1, 2)
    assert main([str(a) for a in args]) == 0
    assert f"loaded {out}" in capsys.readouterr().out
    assert main([str(a) for a in [*args, "--force"]]) == 0
    assert "profiled (forced)" in capsys.readouterr().out
    assert main([str(a) for a in [*args[:6], "1,x"]]) == 2
    assert "--batch-sizes must be comma-separated integers" in capsys.readouterr().err
