"""Verification budgets (spec/budget.py): D-cut (Eq. 19-24), DSpark's Algorithm 1 and its production variant.

Unit tests check the pure functions against literal, slow re-implementations of the paper's definitions
(contiguous prefixes from the tie rule, Eq. 22 budgets, Algorithm 1's pseudo-code step by step); engine
tests check losslessness with each policy active (docs/design.md trap 1): token for token at T=0, and the
distribution of the first emitted tokens at T=1 by a chi-square test, reusing test_engine_spec's helpers."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from test_engine_spec import (  # noqa: F401  (dist_case is a fixture)
    OracleDrafter,
    V,
    _sample_spec,
    assert_bias_detected,
    assert_target_distributed,
    dist_case,
    tiny_decoder,
)

from angelspec.decoding.drafters import DraftLMDrafter
from angelspec.decoding.drafters.base import DraftState, Proposal
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.policies.base import ConfidenceThreshold, sanitize_confidences
from angelspec.decoding.policies.budget import (
    LinearCost,
    StaircaseCost,
    kept_depth,
    masked_scores,
    prefix_survival,
    rank_positions,
)
from angelspec.decoding.policies.dcut import DCUT_RATIOS, DCut, dcut_budget, dcut_depths, dcut_select
from angelspec.decoding.policies.scheduler import PrefixScheduler, ProductionScheduler, prefix_schedule
from angelspec.decoding.sampling import BatchSampling, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_case(rng: random.Random, tied: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """conf [B, K] (with many exact ties when `tied`), active [B], lengths [B]."""
    b, k = rng.randint(1, 6), rng.randint(1, 5)
    pool = [0.0, 0.25, 0.5, 1.0] if tied else None
    conf = torch.tensor([[rng.choice(pool) if pool else rng.random() for _ in range(k)] for _ in range(b)])
    active = torch.tensor([rng.random() < 0.8 for _ in range(b)])
    lengths = torch.tensor([rng.randint(0, k) for _ in range(b)])
    return conf, active, lengths


# ---------------------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------------------


def test_sanitize_counts_and_clamps():
    conf = torch.tensor([[0.5, float("nan"), 1.5], [-0.1, float("inf"), float("-inf")]])
    clean, bad = sanitize_confidences(conf)
    assert int(bad) == 5
    assert clean.tolist() == [[0.5, 0.0, 1.0], [0.0, 1.0, 0.0]]


def test_bad_confidences_never_reach_the_scheduler():
    conf = torch.tensor([[float("nan"), 0.9], [2.0, -3.0]])
    state = _state(torch.tensor([True, True]), k=2)
    for policy in (DCut(LinearCost(1.0, 0.0)), PrefixScheduler(LinearCost(1.0, 0.0)), ProductionScheduler()):
        depth = policy(Proposal(tokens=torch.zeros(2, 2, dtype=torch.int64), confidences=conf), state)
        assert depth.tolist() == [0, 1] or isinstance(policy, ProductionScheduler)
        assert policy.guard.bad_count == 3
    with pytest.raises(ValueError, match="reports confidences"):
        DCut()(Proposal(tokens=torch.zeros(2, 2, dtype=torch.int64)), state)


@pytest.mark.parametrize("tied", [True, False])
def test_top_budget_keeps_contiguous_prefixes(tied):
    """The tie rule (shallower depth first) makes every kept set a contiguous prefix, and the kept set is
    a top-N set: no unkept valid position scores higher than a kept one."""
    rng = random.Random(int(tied))
    for _ in range(300):
        conf, active, lengths = _random_case(rng, tied)
        scores = masked_scores(conf, active, lengths)  # [B, K+1]
        rank = rank_positions(scores)
        n_valid = int((scores >= 0).sum())
        budget = rng.randint(0, scores.numel() + 2)
        kept = (rank < budget) & (scores >= 0)
        depth = kept_depth(scores, rank, budget)
        for i in range(conf.shape[0]):
            row = kept[i].tolist()
            n = sum(row)
            assert row == [True] * n + [False] * (len(row) - n), (conf, budget)  # contiguous prefix
            if n:
                assert depth[i] == n - 1 and (not active[i] or n - 1 <= lengths[i])
        assert int(kept.sum()) == min(budget, n_valid)
        if kept.any() and (~kept & (scores >= 0)).any():
            assert scores[kept].min() >= scores[~kept & (scores >= 0)].max()


def test_prefix_survival_eq20():
    conf = torch.tensor([[0.5, 0.5, 1.0], [1.0, 0.0, 0.9]])
    assert prefix_survival(conf).tolist() == [[1.0, 0.5, 0.25, 0.25], [1.0, 1.0, 0.0, 0.0]]


def test_dcut_budget_eq22():
    # B = 4 requests, D = 3 drafts: B(D+1) = 16 positions (anchor/bonus included).
    assert [dcut_budget(4, 3, r) for r in DCUT_RATIOS] == [4, 8, 12, 16]
    assert dcut_budget(3, 3, 0.75) == 9 and dcut_budget(3, 1, 0.25) == 3  # max(B, .) keeps every anchor
    assert dcut_budget(5, 8, 0.25) == math.ceil(0.25 * 5 * 9)


def _slow_dcut(conf, active, cost, ratios):
    """Eq. 19-24 written out per request with Python lists."""
    b, k = conf.shape
    rows = [i for i in range(b) if active[i]]
    items = []  # (-score, depth, row)
    for i in rows:
        s = 1.0
        items.append((-1.0, 0, i))
        for t in range(k):
            s *= float(conf[i, t])
            items.append((-s, t + 1, i))
    items.sort(key=lambda x: (x[0], x[1], x[2]))
    best, best_val = None, -1.0
    for r in ratios:
        n = max(len(rows), math.ceil(round(r * len(rows) * (k + 1), 9)))
        kept = items[:n]
        depth = [0] * b
        for _, d, i in kept:
            depth[i] = max(depth[i], d)
        u = sum(sum(math.prod(float(conf[i, t]) for t in range(j)) for j in range(depth[i] + 1)) for i in rows)
        val = u / cost(len(rows), n)
        if val > best_val + 1e-12:
            best, best_val = depth, val
    return best


def test_dcut_matches_the_equations():
    rng = random.Random(0)
    for trial in range(200):
        conf, active, _ = _random_case(rng, tied=trial % 2 == 0)
        cost = LinearCost(1.0, rng.choice([0.0, 0.05, 0.3, 1.0]))
        got = dcut_select(conf.double(), active, int(active.sum()), cost)
        assert got.depth.tolist() == _slow_dcut(conf.double(), active, cost, DCUT_RATIOS), (conf, active, cost)


def test_dcut_on_the_host_decides_as_dcut_select_in_double_precision():
    """`DCut` works its depths out on the host (`dcut_depths`, plain Python); on random cases, with exact ties, idle
    rows, short lengths, every max_loss and ratio set, it returns `dcut_select`'s depths on float64 tensors."""
    rng = random.Random(1)
    for trial in range(600):
        conf, active, lengths = _random_case(rng, tied=trial % 2 == 0)
        cost = LinearCost(1.0, rng.choice([0.0, 0.05, 0.3, 1.0]))
        ratios = rng.choice([DCUT_RATIOS, (0.5,), (0.25, 0.5)])
        max_loss = rng.choice([None, 0.0, 0.03, 0.3])
        lens = lengths if trial % 3 else None
        num_active = max(int(active.sum()), 1)
        want = dcut_select(conf.double(), active, num_active, cost, ratios, lens, max_loss).depth.tolist()
        got = dcut_depths(conf.double().tolist(), active.tolist(), num_active, cost, ratios,
                          None if lens is None else lens.tolist(), max_loss)
        assert got == want, (trial, conf, active, lens, cost, ratios, max_loss)
    conf = torch.tensor([[0.9, 0.8, 0.5], [0.7, 0.4, 0.2]])
    state = _state(torch.tensor([True, True]), k=3)
    proposal = Proposal(tokens=torch.zeros(2, 3, dtype=torch.int64), confidences=conf, deterministic=True)
    policy = DCut(cost=LinearCost(1.0, 0.3))
    assert policy(proposal, state).tolist() == dcut_select(conf.double(), state.active, 2, policy.cost).depth.tolist()


def test_dcut_max_loss_keeps_the_expected_acceptance_within_the_bound():
    active = torch.ones(4, dtype=torch.bool)
    conf = torch.tensor([[0.9, 0.8, 0.5], [0.7, 0.4, 0.2], [0.3, 0.1, 0.1], [0.95, 0.9, 0.9]])
    per_token = LinearCost(0.0, 1.0)  # verification cost grows with every token: U / C favours the fewest
    free = dcut_select(conf, active, 4, per_token)
    assert int(free.ratio_index) == 0
    full_u = float(prefix_survival(conf).sum())
    for bound in (0.0, 0.03, 0.1, 0.3):
        d = dcut_select(conf, active, 4, per_token, max_loss=bound)
        assert float(d.utility[d.ratio_index]) >= (1 - bound) * full_u - 1e-6
        # ... and it is the cheapest ratio within the bound (the best U / C among them, cost per token).
        within = [i for i, u in enumerate(d.utility.tolist()) if u >= (1 - bound) * full_u - 1e-6]
        assert int(d.ratio_index) == within[0]
    assert int(dcut_select(conf, active, 4, per_token, max_loss=0.0).ratio_index) == 3  # nothing may be lost
    assert int(dcut_select(conf, active, 4, per_token, max_loss=0.999).ratio_index) == 0
    # Without ratio 1 no ratio may qualify: the largest budget is used.
    assert int(dcut_select(conf, active, 4, per_token, ratios=(0.25, 0.5), max_loss=0.0).ratio_index) == 1
    with pytest.raises(ValueError, match="max_loss must lie in"):
        DCut(max_loss=1.0)


def test_dcut_operating_points():
    conf = torch.full((4, 3), 0.9)
    active = torch.ones(4, dtype=torch.bool)
    free = dcut_select(conf, active, 4, LinearCost(1.0, 0.0))  # verification is free: keep everything
    assert free.depth.tolist() == [3, 3, 3, 3] and int(free.ratio_index) == 3
    dear = dcut_select(torch.full((4, 3), 0.1), active, 4, LinearCost(0.0, 1.0))  # pay per token, bad drafts
    assert dear.depth.tolist() == [0, 0, 0, 0] and int(dear.ratio_index) == 0
    mixed = dcut_select(torch.tensor([[0.9, 0.9, 0.9], [0.1, 0.1, 0.1]]), active[:2], 2, LinearCost(1.0, 0.25))
    # rho* = 0.5: 4 positions = 2 anchors + the 2 best drafts, both of the predictable request
    # (U/C = 2/1.5, 3.71/2, 4.539/2.5, 4.549/3 for the four ratios).
    assert mixed.depth.tolist() == [2, 0] and int(mixed.ratio_index) == 1


def _slow_algorithm1(conf, active, cost, eps, search):
    """Algorithm 1 line by line (0-based j: a_{r,j} covers drafts 0..j; l_r counts admitted drafts)."""
    b, k = conf.shape
    rows = [r for r in range(b) if active[r]]
    a = {(r, j): math.prod(float(conf[r, i]) for i in range(j + 1)) for r in rows for j in range(k)}
    cand = sorted((rj for rj in a if a[rj] > eps), key=lambda rj: (-a[rj], rj[1], rj[0]))
    ell, big_b, tau = dict.fromkeys(rows, 0), len(rows), float(len(rows))

    def sps(n):
        return 1.0 / cost(len(rows), n)

    if search == "greedy":
        theta_star = tau * sps(big_b)
        for r, j in cand:
            if ell[r] != j:
                continue  # non-contiguous prefix: skip
            ell[r], big_b, tau = j + 1, big_b + 1, tau + a[r, j]
            theta = tau * sps(big_b)
            if theta > theta_star:
                theta_star = theta
            else:
                ell[r] = j  # early stop
                break
        return [ell.get(r, 0) for r in range(b)]
    # global: every prefix of the walk, the best one
    best, best_theta, walk = dict(ell), tau * sps(big_b), dict(ell)
    for r, j in cand:
        walk[r], big_b, tau = j + 1, big_b + 1, tau + a[r, j]
        if tau * sps(big_b) > best_theta + 1e-12:
            best, best_theta = dict(walk), tau * sps(big_b)
    return [best.get(r, 0) for r in range(b)]


@pytest.mark.parametrize("search", ["greedy", "global"])
def test_algorithm1_matches_pseudocode(search):
    rng = random.Random(1)
    for trial in range(200):
        conf, active, _ = _random_case(rng, tied=trial % 2 == 0)
        cost = rng.choice([LinearCost(1.0, 0.2), LinearCost(0.5, 0.05), StaircaseCost(1.0, 0.5, 4)])
        got = prefix_schedule(conf.double(), active, int(active.sum()), cost, search=search)
        assert got.tolist() == _slow_algorithm1(conf.double(), active, cost, 1e-6, search), (conf, active, cost)


def test_global_search_escapes_the_staircase():
    """Tiles of 8 tokens: the 9th position costs a whole new tile, so the greedy walk stops at 8 even though
    filling the second tile pays off; the global search finds it."""
    conf = torch.full((4, 4), 0.95)
    active = torch.ones(4, dtype=torch.bool)
    cost = StaircaseCost(fixed=1.0, per_tile=1.0, tile=8)  # Theta(8) = 7.8/2, Theta(9) = 8.7/3, Theta(16) = 14.8/3
    greedy = prefix_schedule(conf, active, 4, cost, search="greedy")
    best = prefix_schedule(conf, active, 4, cost, search="global")
    assert int(greedy.sum()) + 4 == 8 and int(best.sum()) + 4 == 16


# ---------------------------------------------------------------------------------------------------------
# Production variant: stale confidences
# ---------------------------------------------------------------------------------------------------------


def _state(active: torch.Tensor, k: int, draft_round: torch.Tensor | None = None) -> DraftState:
    b = active.shape[0]
    return DraftState(last_tokens=torch.zeros(b, dtype=torch.int64), seq_lens=torch.full((b,), 5),
                      active=active, active_rows=tuple(int(i) for i in torch.nonzero(active).flatten()),
                      sampling=BatchSampling.from_params([SamplingParams(seed=0)] * b),
                      draft_round=torch.zeros(b, dtype=torch.int64) if draft_round is None else draft_round,
                      num_draft_tokens=k, deterministic=False, all_greedy=False, seq_len_bound=5)


def test_production_declaration_is_fixed_at_construction_and_never_unsafe():
    """Trap 1: like DCut and PrefixScheduler, the production scheduler's `uses_proposal` is decided when it is built
    (the engine reads it once), and reading this round's confidences while declaring otherwise is refused."""
    assert ProductionScheduler().uses_proposal is False
    assert ProductionScheduler(allocation="current").uses_proposal is True
    assert ProductionScheduler(allocation="stale", uses_proposal=True).uses_proposal is True  # safe, conservative
    with pytest.raises(ValueError, match=r"allocation='current'.*uses_proposal=False \(trap 1\)"):
        ProductionScheduler(allocation="current", uses_proposal=False)
    with pytest.raises(ValueError, match=r"uses_proposal=False \(trap 1\)"):
        ConfidenceThreshold(0.5, uses_proposal=False)  # reads this round's confidences too
    for policy in (ProductionScheduler(), ProductionScheduler(allocation="current"), DCut(), PrefixScheduler(),
                   ConfidenceThreshold(0.5)):
        with pytest.raises(AttributeError):
            policy.uses_proposal = not policy.uses_proposal


def test_production_uses_confidences_exactly_lag_steps_old():
    policy = ProductionScheduler(LinearCost(1.0, 0.0), lag=2, cold_confidence=0.0)
    assert policy.uses_proposal is False and ProductionScheduler(allocation="current").uses_proposal is True
    active = torch.ones(2, dtype=torch.bool)
    confs = [torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 1.0]]),
             torch.tensor([[0.5, 0.5], [0.5, 0.5]])]
    depths = []
    for step, c in enumerate(confs + confs[:1]):
        rnd = torch.tensor([step, step if step < 3 else 0])  # row 1 gets a new request at step 3
        depths.append(policy(Proposal(tokens=torch.zeros(2, 2, dtype=torch.int64), confidences=c),
                             _state(active, 2, rnd)).tolist())
    # steps 0, 1: no history -> the cold prior (0: verify nothing); step 2 sees step 0's confidences;
    # step 3: row 0 sees step 1's, row 1 is a new request (round 0) and falls back to the prior.
    assert depths == [[0, 0], [0, 0], [2, 0], [0, 0]]
    with pytest.raises(ValueError, match="lag"):
        ProductionScheduler(lag=0)


# ---------------------------------------------------------------------------------------------------------
# Losslessness through the engine
# ---------------------------------------------------------------------------------------------------------


def _policies(batch: int, k: int, lag: int = 2) -> dict[str, object]:
    cost = LinearCost(1.0, 1.0 / batch)  # one verify of B anchors doubles the fixed cost: pruning pays off
    return {
        "dcut": DCut(cost),
        "alg1-greedy": PrefixScheduler(cost),
        "alg1-global": PrefixScheduler(StaircaseCost(1.0, 4.0 / batch, 4), search="global"),
        "production-current": ProductionScheduler(cost, allocation="current", lag=lag),
        "production-stale": ProductionScheduler(cost, allocation="stale", lag=lag, cold_confidence=0.3),
    }


@pytest.fixture(scope="module")
def small_greedy_case():
    target = tiny_decoder()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(10)]
    requests = [Request(p, max_new_tokens=48, stop_ids=()) for p in prompts]
    ar = SpecEngine(target, config=EngineConfig(max_batch_size=10)).generate(requests)
    return target, requests, [r.token_ids for r in ar], {tuple(p): r.token_ids for p, r in zip(prompts, ar,
                                                                                                 strict=True)}


@pytest.mark.parametrize("name", list(_policies(4, 4)))
def test_greedy_equals_ar_with_each_policy(small_greedy_case, name):
    target, requests, ar_tokens, continuations = small_greedy_case
    policy = _policies(4, 4)[name]
    engine = SpecEngine(target, OracleDrafter(continuations, error=0.3, seed=7, ragged=name == "dcut"),
                        EngineConfig(max_batch_size=4, num_draft_tokens=4), depth_policy=policy)
    out = engine.generate(requests)
    assert [r.token_ids for r in out] == ar_tokens
    m = engine.metrics
    assert sum(n > 0 for n in m.depth_hist) >= 2, m.depth_hist  # the policy really varies depths
    assert m.mean_accepted_length > 1.2


@pytest.mark.parametrize("name", list(_policies(4, 4)))
def test_t1_distribution_with_each_policy(dist_case, name):  # noqa: F811
    tgt, draft, joint = dist_case
    n = 3000
    policy = _policies(n, 3, lag=1)[name]  # lag 1: with 3 tokens, stale records are used in the 2nd round
    y, metrics = _sample_spec(tgt, DraftLMDrafter(draft), policy, n=n)
    expected = "speculative" if name == "production-stale" else "deterministic"
    assert set(metrics.protocols) == {expected}
    assert sum(c > 0 for c in metrics.depth_hist) >= 2, metrics.depth_hist
    # Drafts get accepted, so verification is exercised (the stale variant's first round is cold-started).
    assert metrics.mean_accepted_length > (1.05 if name == "production-stale" else 1.2)
    assert_target_distributed(y, joint, name)


def test_existing_threshold_baseline_is_reused():
    """The per-request threshold baseline lives in drafter.py; D-cut's score is the same prefix product."""
    conf = torch.tensor([[0.9, 0.9, 0.5], [0.4, 1.0, 1.0]])
    state = _state(torch.ones(2, dtype=torch.bool), 3)
    depth = ConfidenceThreshold(0.5)(Proposal(tokens=torch.zeros(2, 3, dtype=torch.int64), confidences=conf), state)
    assert depth.tolist() == [2, 0]
    assert (prefix_survival(conf)[:, 1:] >= 0.5).long().cumprod(-1).sum(-1).tolist() == depth.tolist()


@dataclass(frozen=True)
class ClaimsNotToReadTheProposal:
    """The lie under test: wraps a policy that reads this round's proposal and declares uses_proposal=False. The
    library's policies refuse that declaration, so only a test can build it."""

    policy: Callable[[Proposal, DraftState], torch.Tensor]
    uses_proposal: bool = False
    static_depth: int | None = None

    def __call__(self, proposal: Proposal, state: DraftState) -> torch.Tensor:
        return self.policy(proposal, state)


def test_t1_detects_current_confidences_under_standard_sampling(dist_case):  # noqa: F811
    """Control for the stale test: the same scheduler allocating by THIS round's sampled-draft confidences
    while claiming uses_proposal=False (trap 1) is biased, and the same statistics reject it."""
    tgt, draft, joint = dist_case
    n = 3000
    policy = ClaimsNotToReadTheProposal(ProductionScheduler(LinearCost(1.0, 1.0 / n), allocation="current", lag=1))
    y, metrics = _sample_spec(tgt, DraftLMDrafter(draft), policy, n=n)
    assert set(metrics.protocols) == {"speculative"}
    assert_bias_detected(y, joint, factor=2.0)


def test_edge_cases_k0_and_bad_costs():
    state = _state(torch.ones(3, dtype=torch.bool), k=0)
    empty = Proposal(tokens=torch.zeros(3, 0, dtype=torch.int64), confidences=torch.zeros(3, 0))
    for policy in _policies(3, 0).values():
        assert policy(empty, state).tolist() == [0, 0, 0]
    conf = torch.full((2, 2), 0.5)
    with pytest.raises(ValueError, match="non-positive"):
        dcut_select(conf, torch.ones(2, dtype=torch.bool), 2, lambda r, n: 0.0)
    with pytest.raises(ValueError, match="non-positive"):
        prefix_schedule(conf, torch.ones(2, dtype=torch.bool), 2, lambda r, n: float("nan"))


def test_confidence_threshold_never_sees_nan_or_out_of_range() -> None:
    from angelspec.decoding.policies.base import ConfidenceThreshold

    policy = ConfidenceThreshold(threshold=0.5)
    conf = torch.tensor([[float("nan"), 1.0, 1.0], [1.7, 0.9, float("nan")], [-0.2, 1.0, 1.0]])
    proposal = Proposal(tokens=torch.zeros(3, 3, dtype=torch.long), confidences=conf)
    state = SimpleNamespace(num_draft_tokens=3)
    # NaN / negative -> 0 (stop), above 1 -> 1: depths 0, 2 (1 * 0.9 then NaN -> 0), 0
    assert policy(proposal, state).tolist() == [0, 2, 0]
