"""Tests for angelspec.train.losses against brute-force references (Python loops over positions and vocab,
Python floats = float64) and `torch.autograd.gradcheck` (float64, tiny sizes).

Losses with a stop-gradient (λ of LK^λ, the D-PACE weights, the DSpark confidence target) are not the
gradient of their own value, so plain gradcheck would (rightly) fail on them. For those the test freezes
the stop-gradient quantity at the evaluation point, gradchecks that surrogate, and checks that the loss's
autograd gradient equals the surrogate's.
Shape legend: N positions, K depths / block positions, V vocab.
"""

import math

import pytest
import torch

from angelspec.train.losses import (
    LOSSES,
    NO_LOSS,
    ChunkedLossBatch,
    LossBatch,
    LossConfig,
    LossOutput,
    LossSchedule,
    acceptance_per_depth,
    cross_entropy,
    dpace_lk_loss,
    dpace_weights,
    dspark_loss,
    dspark_position_weights,
    e2e_tv_loss,
    forward_kl,
    get_loss,
    lk_alpha_loss,
    lk_lambda_loss,
    normalize_depth_weights,
    token_alpha,
    token_ce,
    token_kl,
    token_tv,
    tv_loss,
)

N, K, V = 4, 3, 6
TOP_K = 3
WEIGHTS = (1.0, 0.5, 0.25)
# Row 0 and 3 valid at every depth (the e2e set I), row 1 stops early, row 2 starts late (non-monotone).
MASK = [[True, True, True], [True, True, False], [False, True, True], [True, True, True]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny tensors on a shared 2-core machine: extra intra-op threads only add barrier overhead.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_batch(seed: int = 0, *, with_confidence: bool = True) -> LossBatch:
    g = torch.Generator().manual_seed(seed)
    student = (2 * torch.randn(N, K, V, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = 2 * torch.randn(N, K, V, generator=g, dtype=torch.float64)
    mask = torch.tensor(MASK)
    labels = torch.randint(0, V, (N, K), generator=g).masked_fill(~mask, -100)  # -100: must never be gathered
    conf = torch.randn(N, K, generator=g, dtype=torch.float64).requires_grad_() if with_confidence else None
    return LossBatch(student, mask, teacher, labels, conf)


# ---------------------------------------------------------------------------------------------------------
# brute-force references
# ---------------------------------------------------------------------------------------------------------


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    z = sum(e)
    return [x / z for x in e]


def ref_pq(q_logits: list[float], p_logits: list[float], top_k: int | None) -> tuple[list[float], list[float]]:
    """(p̃ over the full vocab with zeros off the teacher's top-K, full-vocab student q)."""
    ids = sorted(range(len(p_logits)), key=lambda v: -p_logits[v])[: top_k or len(p_logits)]
    p = [0.0] * len(p_logits)
    for v, pv in zip(ids, softmax([p_logits[v] for v in ids]), strict=True):
        p[v] = pv
    return p, softmax(q_logits)


def ref_kl(q_logits, p_logits, top_k=None) -> float:
    p, q = ref_pq(q_logits, p_logits, top_k)
    return sum(p[v] * math.log(p[v] / q[v]) for v in range(len(p)) if p[v] > 0)


def ref_tv(q_logits, p_logits, top_k=None) -> float:
    p, q = ref_pq(q_logits, p_logits, top_k)
    return 0.5 * sum(abs(p[v] - q[v]) for v in range(len(p)))  # Eq. 4 literally


def ref_alpha(q_logits, p_logits, top_k=None) -> float:
    p, q = ref_pq(q_logits, p_logits, top_k)
    return sum(min(p[v], q[v]) for v in range(len(p)))  # Eq. 5 literally


def ref_ce(q_logits, label) -> float:
    return -math.log(softmax(q_logits)[label])


def ref_depth_mean(term, mask, weights=None) -> float:
    """Eq. 3: Σ_k w_k (1/|I_k|) Σ_{i∈I_k} term(i, k), w normalised."""
    depth = len(mask[0])
    w = [1.0] * depth if weights is None else list(weights)
    total = 0.0
    for k in range(depth):
        idx = [i for i in range(len(mask)) if mask[i][k]]
        if idx:
            total += w[k] / sum(w) * sum(term(i, k) for i in idx) / len(idx)
    return total


def ref_lk_lambda(q, p, eta, top_k=None) -> float:
    lam = math.exp(-eta * ref_alpha(q, p, top_k))
    return lam * ref_kl(q, p, top_k) + (1 - lam) * ref_tv(q, p, top_k)


def ref_e2e(s, t, mask, top_k=None) -> float:
    rows = [i for i in range(len(mask)) if all(mask[i])]
    depth = len(mask[0])
    total = 0.0
    for i in rows:
        for m in range(depth):
            prod = 1.0
            for k in range(m + 1):
                prod *= ref_alpha(s[i][k], t[i][k], top_k)
            total += prod
    return 1 - total / (len(rows) * depth)


def ref_dpace_weights(s, labels, mask, rho) -> list[list[float]]:
    out = []
    for i in range(len(mask)):
        s_tilde = [(1 - rho) * math.exp(-ref_ce(s[i][r], labels[i][r])) + rho if mask[i][r] else 1.0
                   for r in range(len(mask[i]))]
        row = []
        for k in range(len(mask[i])):
            w = 0.0
            for m in range(k, len(mask[i])):
                if mask[i][m]:
                    w += math.prod(s_tilde[: m + 1])
            row.append(w if mask[i][k] else 0.0)
        out.append(row)
    return out


def ref_dspark(s, t, labels, conf, mask, gamma, top_k=None, coefs=(0.1, 0.9, 1.0), l1_scale=2.0) -> float:
    """The DSpark loss with L_TV = l1_scale·TV: 2·TV = ‖p − q‖₁ (the report), 1·TV = ½‖p − q‖₁ (tv_norm half_l1)."""
    num_ce = num_tv = num_conf = den = 0.0
    for i in range(len(mask)):
        for k in range(len(mask[i])):
            if not mask[i][k]:
                continue
            w = math.exp(-k / gamma)  # k is 0-based here: exp(−(k₁−1)/γ) with k₁ = k + 1
            tv = ref_tv(s[i][k], t[i][k], top_k)
            c = 1 / (1 + math.exp(-conf[i][k]))
            target = 1 - tv
            den += w
            num_ce += w * ref_ce(s[i][k], labels[i][k])
            num_tv += w * l1_scale * tv
            num_conf += w * -(target * math.log(c) + (1 - target) * math.log(1 - c))
    return (coefs[0] * num_ce + coefs[1] * num_tv + coefs[2] * num_conf) / den


def lists(b: LossBatch):
    return b.student_logits.tolist(), b.teacher_logits.tolist(), b.labels.tolist(), b.mask.tolist()


# ---------------------------------------------------------------------------------------------------------
# per-token terms
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [None, TOP_K])
def test_token_terms_match_brute_force(top_k):
    b = make_batch()
    s, t, labels, mask = lists(b)
    kl = token_kl(b.student_logits, b.teacher_logits, top_k)
    tv = token_tv(b.student_logits, b.teacher_logits, top_k)
    alpha = token_alpha(b.student_logits, b.teacher_logits, top_k)
    assert kl.shape == tv.shape == alpha.shape == (N, K)
    for i in range(N):
        for k in range(K):
            assert kl[i, k].item() == pytest.approx(ref_kl(s[i][k], t[i][k], top_k), abs=1e-12)
            assert tv[i, k].item() == pytest.approx(ref_tv(s[i][k], t[i][k], top_k), abs=1e-12)
            assert alpha[i, k].item() == pytest.approx(ref_alpha(s[i][k], t[i][k], top_k), abs=1e-12)
    ce = token_ce(b.student_logits, b.labels.clamp_min(0))
    for i in range(N):
        for k in range(K):
            assert ce[i, k].item() == pytest.approx(ref_ce(s[i][k], max(labels[i][k], 0)), abs=1e-12)


def test_top_k_equal_vocab_is_exactly_full_kl():
    b = make_batch()
    full = token_kl(b.student_logits, b.teacher_logits, None)
    for top_k in (V, V + 10):
        assert torch.allclose(token_kl(b.student_logits, b.teacher_logits, top_k), full, rtol=0, atol=1e-14)
    assert torch.allclose(forward_kl(b.student_logits, b.teacher_logits, b.mask, WEIGHTS, V),
                          forward_kl(b.student_logits, b.teacher_logits, b.mask, WEIGHTS, None), rtol=0, atol=1e-14)
    s, t, _, _ = lists(b)
    assert full[0, 0].item() == pytest.approx(ref_kl(s[0][0], t[0][0]), abs=1e-12)


def test_kl_nonnegative_and_zero_iff_equal():
    g = torch.Generator().manual_seed(1)
    q, p = torch.randn(200, V, generator=g, dtype=torch.float64), torch.randn(200, V, generator=g, dtype=torch.float64)
    for top_k in (None, TOP_K):
        assert (token_kl(q, p, top_k) > 0).all()  # p ≠ q almost surely
    assert token_kl(p, p).abs().max() < 1e-13
    # On a top-K support KL_S is zero iff q = p̃ (teacher renormalised on S, student zero off S) ...
    ids = p.topk(TOP_K, dim=-1).indices
    q_on_support = torch.full_like(p, -1e4).scatter(-1, ids, p.gather(-1, ids))
    assert token_kl(q_on_support, p, TOP_K).abs().max() < 1e-13
    # ... and q = p is *not* a zero: the student's mass off S is charged −log q(S) (full-vocab student).
    mass_on_support = p.softmax(-1).gather(-1, ids).sum(-1)
    assert torch.allclose(token_kl(p, p, TOP_K), -mass_on_support.log(), atol=1e-13)


def test_tv_in_unit_interval_and_alpha_is_overlap():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(100, V, generator=g, dtype=torch.float64) * torch.tensor([0.1, 1.0, 10.0, 50.0]).repeat(25)[:, None]
    p = torch.randn(100, V, generator=g, dtype=torch.float64) * 5
    for top_k in (None, TOP_K):
        tv, alpha = token_tv(q, p, top_k), token_alpha(q, p, top_k)
        assert (tv >= 0).all() and (tv <= 1).all()
        assert torch.allclose(alpha + tv, torch.ones_like(tv), atol=1e-15)
        for r in range(0, 100, 7):
            assert alpha[r].item() == pytest.approx(ref_alpha(q[r].tolist(), p[r].tolist(), top_k), abs=1e-12)
            assert tv[r].item() == pytest.approx(ref_tv(q[r].tolist(), p[r].tolist(), top_k), abs=1e-12)


# ---------------------------------------------------------------------------------------------------------
# masked losses vs brute force
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [None, TOP_K])
def test_masked_losses_match_brute_force(top_k):
    b = make_batch()
    s, t, labels, mask = lists(b)
    conf = b.confidence_logits.tolist()
    eta, eps, rho = 2.0, 1e-6, 0.3
    st, te, m, y = b.student_logits, b.teacher_logits, b.mask, b.labels

    assert cross_entropy(st, y, m, WEIGHTS).item() == pytest.approx(
        ref_depth_mean(lambda i, k: ref_ce(s[i][k], labels[i][k]), mask, WEIGHTS), abs=1e-12)
    assert forward_kl(st, te, m, WEIGHTS, top_k).item() == pytest.approx(
        ref_depth_mean(lambda i, k: ref_kl(s[i][k], t[i][k], top_k), mask, WEIGHTS), abs=1e-12)
    assert tv_loss(st, te, m, WEIGHTS, top_k).item() == pytest.approx(
        ref_depth_mean(lambda i, k: ref_tv(s[i][k], t[i][k], top_k), mask, WEIGHTS), abs=1e-12)
    assert lk_lambda_loss(st, te, m, WEIGHTS, top_k, eta).item() == pytest.approx(
        ref_depth_mean(lambda i, k: ref_lk_lambda(s[i][k], t[i][k], eta, top_k), mask, WEIGHTS), abs=1e-12)
    assert lk_alpha_loss(st, te, m, WEIGHTS, top_k, eps).item() == pytest.approx(
        ref_depth_mean(lambda i, k: -math.log(ref_alpha(s[i][k], t[i][k], top_k) + eps), mask, WEIGHTS), abs=1e-12)
    assert e2e_tv_loss(st, te, m, top_k).item() == pytest.approx(ref_e2e(s, t, mask, top_k), abs=1e-12)

    w = ref_dpace_weights(s, labels, mask, rho)
    num = sum(w[i][k] * ref_lk_lambda(s[i][k], t[i][k], eta, top_k) for i in range(N) for k in range(K) if mask[i][k])
    den = sum(w[i][k] for i in range(N) for k in range(K) if mask[i][k])
    assert dpace_lk_loss(st, te, y, m, top_k, eta, rho, eps).item() == pytest.approx(num / (den + eps), abs=1e-12)

    out = dspark_loss(st, te, y, m, b.confidence_logits, LossConfig(top_k=top_k, gamma=2.0))
    assert out.loss.item() == pytest.approx(ref_dspark(s, t, labels, conf, mask, 2.0, top_k), abs=1e-12)
    assert set(out.parts) == {"ce", "tv", "conf"} and not any(v.requires_grad for v in out.parts.values())
    default_gamma = dspark_loss(st, te, y, m, b.confidence_logits, LossConfig(top_k=top_k)).loss  # γ = K
    assert default_gamma.item() == pytest.approx(ref_dspark(s, t, labels, conf, mask, float(K), top_k), abs=1e-12)
    half = dspark_loss(st, te, y, m, b.confidence_logits, LossConfig(top_k=top_k, gamma=2.0, tv_norm="half_l1")).loss
    assert half.item() == pytest.approx(ref_dspark(s, t, labels, conf, mask, 2.0, top_k, l1_scale=1.0), abs=1e-12)

    per_depth = acceptance_per_depth(st, te, m, top_k)
    for k in range(K):
        idx = [i for i in range(N) if mask[i][k]]
        assert per_depth[k].item() == pytest.approx(sum(ref_alpha(s[i][k], t[i][k], top_k) for i in idx) / len(idx))


# ---------------------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------------------


def _gradcheck(fn, *inputs) -> None:
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("top_k", [None, TOP_K])
def test_gradcheck_losses_without_stop_gradient(top_k):
    b = make_batch(3)
    te, m, y = b.teacher_logits, b.mask, b.labels
    x = b.student_logits.detach().requires_grad_()
    _gradcheck(lambda x: token_kl(x, te, top_k), x)
    _gradcheck(lambda x: token_tv(x, te, top_k), x)
    _gradcheck(lambda x: cross_entropy(x, y, m, WEIGHTS), x)
    _gradcheck(lambda x: forward_kl(x, te, m, WEIGHTS, top_k), x)
    _gradcheck(lambda x: tv_loss(x, te, m, WEIGHTS, top_k), x)
    _gradcheck(lambda x: lk_alpha_loss(x, te, m, WEIGHTS, top_k, 1e-6), x)
    _gradcheck(lambda x: e2e_tv_loss(x, te, m, top_k), x)
    # DSpark's confidence term: the only path from the loss to the confidence head.
    _gradcheck(lambda c: dspark_loss(x.detach(), te, y, m, c, LossConfig(top_k=top_k)).loss, b.confidence_logits)


def _surrogate_depth_mean(per_token, mask, weights):
    w = normalize_depth_weights(weights, mask.shape[1], dtype=per_token.dtype)
    return (w * (per_token * mask).sum(0) / mask.sum(0)).sum()


def _grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("top_k", [None, TOP_K])
def test_lk_lambda_gradient_treats_lambda_as_constant(top_k):
    b = make_batch(4)
    te, m, eta = b.teacher_logits, b.mask, 2.0
    x = b.student_logits.detach().requires_grad_()
    lam0 = torch.exp(-eta * token_alpha(x, te, top_k)).detach()  # [N, K], frozen at x

    def surrogate(z):
        return _surrogate_depth_mean(lam0 * token_kl(z, te, top_k) + (1 - lam0) * token_tv(z, te, top_k), m, WEIGHTS)

    _gradcheck(surrogate, x)
    assert torch.allclose(_grad(lk_lambda_loss(x, te, m, WEIGHTS, top_k, eta), x), _grad(surrogate(x), x), atol=1e-13)


def test_lk_lambda_limits():
    eta = 3.0
    # α → 0: disjoint peaks, λ = exp(−η·α) → 1, so LK^λ → KL.
    p = torch.zeros(2, 1, V, dtype=torch.float64)
    q = torch.zeros(2, 1, V, dtype=torch.float64)
    p[..., 0], q[..., 1] = 30.0, 30.0
    m = torch.ones(2, 1, dtype=torch.bool)
    assert tv_loss(q, p, m).item() == pytest.approx(1.0, abs=1e-11)
    kl = forward_kl(q, p, m).item()
    assert lk_lambda_loss(q, p, m, eta=eta).item() == pytest.approx(kl, rel=1e-10)
    # α → 1: λ → exp(−η): the loss is exp(−η)·KL + (1 − exp(−η))·TV, and → TV as η grows.
    b = make_batch(5)
    q = b.teacher_logits + 1e-3 * b.student_logits.detach()
    s, t, m = q.tolist(), b.teacher_logits.tolist(), torch.ones(N, K, dtype=torch.bool)
    for i in range(N):
        for k in range(K):
            a = ref_alpha(s[i][k], t[i][k])
            assert a > 0.99
            got = lk_lambda_loss(q[i:i + 1, k:k + 1], b.teacher_logits[i:i + 1, k:k + 1], m[:1, :1], eta=eta).item()
            lam = math.exp(-eta * a)
            expected = lam * ref_kl(s[i][k], t[i][k]) + (1 - lam) * ref_tv(s[i][k], t[i][k])
            assert got == pytest.approx(expected, rel=1e-10)
    tv = tv_loss(q, b.teacher_logits, m).item()
    assert lk_lambda_loss(q, b.teacher_logits, m, eta=60.0).item() == pytest.approx(tv, rel=1e-12)
    assert lk_lambda_loss(q, b.teacher_logits, m, eta=0.0).item() == pytest.approx(
        forward_kl(q, b.teacher_logits, m).item(), rel=1e-12)


@pytest.mark.parametrize("top_k", [None, TOP_K])
def test_lk_alpha_gradient_is_tv_gradient_scaled(top_k):
    """Eq. 8: ∇L^α_LK = ∇TV / (α + ε), row by row (each row's loss weight is the same in both losses)."""
    b = make_batch(6)
    te, m, eps = b.teacher_logits, b.mask, 1e-3
    x = b.student_logits.detach().requires_grad_()
    g_lk = _grad(lk_alpha_loss(x, te, m, WEIGHTS, top_k, eps), x)
    g_tv = _grad(tv_loss(x, te, m, WEIGHTS, top_k), x)
    alpha = token_alpha(x, te, top_k).detach()  # [N, K]
    assert torch.allclose(g_lk, g_tv / (alpha + eps)[..., None], atol=1e-13)
    assert g_tv[m].abs().sum() > 0  # the check is not vacuous


def test_e2e_tv_extremes():
    b = make_batch(7)
    te = b.teacher_logits
    full = torch.ones(N, K, dtype=torch.bool)
    for top_k in (None, V):
        assert abs(e2e_tv_loss(te.clone(), te, full, top_k).item()) < 1e-13  # all α = 1
    q = b.student_logits.detach().clone()
    p = te.clone()
    p[:, 0], q[:, 0] = -50.0, -50.0
    p[:, 0, 0], q[:, 0, 1] = 50.0, 50.0  # α_{i,0} ≈ 0 kills every prefix product
    assert token_alpha(q[:, 0], p[:, 0]).max() < 1e-40
    for top_k in (None, TOP_K):
        assert e2e_tv_loss(q, p, full, top_k).item() == pytest.approx(1.0, abs=1e-13)


def test_e2e_tv_uses_only_rows_valid_at_every_depth():
    b = make_batch(8)
    s, t, _, mask = lists(b)
    only_full = torch.tensor([all(r) for r in MASK])[:, None].expand(N, K)
    a = e2e_tv_loss(b.student_logits, b.teacher_logits, b.mask)
    assert torch.equal(a, e2e_tv_loss(b.student_logits, b.teacher_logits, only_full.contiguous()))
    assert a.item() == pytest.approx(ref_e2e(s, t, mask), abs=1e-12)


def test_dpace_weights_hand_example():
    def logits_for(conf):  # V = 2, label 0: q(label) = conf exactly
        return [[math.log(c), math.log(1 - c)] for c in conf]

    student = torch.tensor([logits_for([0.5, 0.2, 0.8]), logits_for([0.5, 0.2, 0.8])], dtype=torch.float64)
    labels = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.tensor([[True, True, True], [True, False, True]])
    w = dpace_weights(student.requires_grad_(), labels, mask, rho=0.5)
    # Row 0: s̃ = (.75, .6, .9), prefix products (.75, .45, .405), suffix sums (1.605, .855, .405).
    # Row 1: depth 1 invalid -> s̃ = 1 in the products, its own term dropped: (.75, —, .675) -> (1.425, 0, .675).
    expected = torch.tensor([[1.605, 0.855, 0.405], [1.425, 0.0, 0.675]], dtype=torch.float64)
    assert torch.allclose(w, expected, atol=1e-12)
    assert not w.requires_grad and w.grad_fn is None
    s0 = dpace_weights(student, labels, mask, rho=0.0)  # ρ = 0: raw confidences
    assert torch.allclose(s0[0], torch.tensor([0.5 + 0.1 + 0.08, 0.1 + 0.08, 0.08], dtype=torch.float64))
    assert torch.equal(dpace_weights(student, labels, mask, rho=1.0)[0], torch.tensor([3.0, 2.0, 1.0]).double())
    b = make_batch(9)
    s, _, labels_l, mask_l = lists(b)
    assert torch.allclose(dpace_weights(b.student_logits, b.labels, b.mask, 0.3),
                          torch.tensor(ref_dpace_weights(s, labels_l, mask_l, 0.3), dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("top_k", [None, TOP_K])
def test_dpace_lk_gradient_treats_weights_as_constant(top_k):
    b = make_batch(10)
    te, y, m, eta, rho, eps = b.teacher_logits, b.labels, b.mask, 2.0, 0.3, 1e-6
    x = b.student_logits.detach().requires_grad_()
    w0 = dpace_weights(x, y, m, rho)
    lam0 = torch.exp(-eta * token_alpha(x, te, top_k)).detach()

    def surrogate(z):
        lk = (lam0 * token_kl(z, te, top_k) + (1 - lam0) * token_tv(z, te, top_k)) * m
        return (w0 * lk).sum() / (w0.sum() + eps)

    _gradcheck(surrogate, x)
    assert torch.allclose(_grad(dpace_lk_loss(x, te, y, m, top_k, eta, rho, eps), x), _grad(surrogate(x), x),
                          atol=1e-13)


def test_dspark_tv_term_is_the_reports_l1_distance_by_default():
    """One position, V = 3, by hand: p_t = (0.5, 0.3, 0.2), p_d = (0.2, 0.2, 0.6), label 0, confidence logit 0.
    ‖p_d − p_t‖₁ = 0.3 + 0.1 + 0.4 = 0.8, CE = −log 0.2, α = 1 − 0.4 = 0.6, BCE(σ(0) = ½, 0.6) = log 2.
    Report (default): 0.1·CE + 0.9·0.8 + log 2; tv_norm half_l1 (the loss before the option): 0.1·CE + 0.9·0.4
    + log 2."""
    student = torch.tensor([[[0.2, 0.2, 0.6]]], dtype=torch.float64).log()
    teacher = torch.tensor([[[0.5, 0.3, 0.2]]], dtype=torch.float64).log()
    labels, mask, conf = torch.tensor([[0]]), torch.tensor([[True]]), torch.zeros(1, 1, dtype=torch.float64)
    ce = -math.log(0.2)
    report = dspark_loss(student, teacher, labels, mask, conf)
    assert report.loss.item() == pytest.approx(0.1 * ce + 0.9 * 0.8 + math.log(2), abs=1e-12)
    assert report.parts["tv"].item() == pytest.approx(0.8, abs=1e-12)
    assert report.parts["conf"].item() == pytest.approx(math.log(2), abs=1e-12)  # target α = 1 − ½‖·‖₁ either way
    old = dspark_loss(student, teacher, labels, mask, conf, LossConfig(tv_norm="half_l1"))
    assert old.loss.item() == pytest.approx(0.1 * ce + 0.9 * 0.4 + math.log(2), abs=1e-12)
    batch = LossBatch(student_logits=student, mask=mask, teacher_logits=teacher, labels=labels, confidence_logits=conf)
    assert LOSSES["dspark"](batch, LossConfig()).loss.item() == pytest.approx(report.loss.item(), abs=1e-15)
    assert LOSSES["dspark"](batch, LossConfig(tv_norm="half_l1")).loss.item() == pytest.approx(old.loss.item(),
                                                                                             abs=1e-15)
    with pytest.raises(ValueError, match="unknown tv_norm 'l2'; choose one of l1, half_l1"):
        LossConfig(tv_norm="l2")


@pytest.mark.parametrize("tv_norm", ["l1", "half_l1"])
@pytest.mark.parametrize("protocol", [False, True])
def test_chunked_dspark_and_confidence_term_equal_the_whole_batch(tv_norm, protocol):
    """DSpark's tv_norm and given confidence targets ([N, K] or a protocol head's [N, K, n]) reach every chunk's
    row sums: chunked (3 rows a chunk, a remainder) equals the whole batch, loss and gradients; so does the
    confidence term alone (`with_confidence_term(NO_LOSS, ·)`, a confidence-only run)."""
    from angelspec.train.losses import with_confidence_term

    g = torch.Generator().manual_seed(11)
    N, K, C, V = 8, 3, 5, 7
    hidden = torch.randn(N, K, C, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, V, generator=g, dtype=torch.float64)
    teacher = torch.randn(N, K, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N, K), generator=g)
    mask = torch.rand(N, K, generator=g) > 0.2
    shape = (N, K, 3) if protocol else (N, K)
    conf = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    def of(lb: LossBatch) -> torch.Tensor:  # targets from a batch's (or chunk's) own teacher logits
        t = torch.sigmoid(lb.teacher_logits[..., :3])
        return t if protocol else t[..., 0]

    targets = of(LossBatch(student_logits=teacher, mask=mask, teacher_logits=teacher))
    config = LossConfig(top_k=4, tv_norm=tv_norm)
    objectives = (LOSSES["dspark"], with_confidence_term(LOSSES["e2e_tv"], 0.5), with_confidence_term(NO_LOSS, 2.0))

    def grad(loss: torch.Tensor) -> list[torch.Tensor]:  # the confidence term alone leaves the states without one
        ds = torch.autograd.grad(loss, (hidden, conf), allow_unused=True)
        return [torch.zeros_like(x) if d is None else d for x, d in zip((hidden, conf), ds, strict=True)]

    for objective in objectives:
        whole = objective(LossBatch(student_logits=hidden @ w, mask=mask, teacher_logits=teacher, labels=labels,
                                    confidence_logits=conf, confidence_targets=targets), config)
        grads = grad(whole.loss)
        for given in (targets, of):  # a tensor (sliced per chunk) or computed from each chunk
            clb = ChunkedLossBatch(hidden=tuple(hidden.unbind(1)), head=lambda z, rows: z @ w, mask=mask, chunk_rows=3,
                                   teacher=lambda rows: teacher[rows], labels=labels, confidence_logits=conf,
                                   confidence_targets=given)
            out = objective(clb, config)
            assert out.loss.item() == pytest.approx(whole.loss.item(), rel=1e-12)
            assert out.parts.keys() == whole.parts.keys()
            for a, b in zip(grad(out.loss), grads, strict=True):
                assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_dspark_weights_and_confidence_target_are_detached():
    w = dspark_position_weights(4, 2.0, dtype=torch.float64)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)], dtype=torch.float64))
    assert not w.requires_grad
    b = make_batch(11)
    te, y, m, c = b.teacher_logits, b.labels, b.mask, b.confidence_logits
    x = b.student_logits.detach().requires_grad_()
    full = dspark_loss(x, te, y, m, c, LossConfig(gamma=2.0)).loss
    g_x, g_c = torch.autograd.grad(full, (x, c))
    # The BCE term sends nothing to the drafter: its student gradient is that of 0.1·CE + 0.9·TV alone.
    assert torch.allclose(g_x, _grad(dspark_loss(x, te, y, m, None, LossConfig(gamma=2.0)).loss, x), atol=1e-14)
    # And ∂/∂c of BCE(σ(c), sg[α]) is w_k (σ(c) − α) / Σ w over valid rows.
    pos = dspark_position_weights(K, 2.0, dtype=torch.float64) * m
    expected = pos * (torch.sigmoid(c.detach()) - token_alpha(x, te).detach()) / pos.sum()
    assert torch.allclose(g_c, expected, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------
# masking, teacher, dtype, registry, schedule
# ---------------------------------------------------------------------------------------------------------


def _run(name: str, b: LossBatch, config: LossConfig) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = LOSSES[name](b, config)
    inputs = [b.student_logits] + ([b.confidence_logits] if name == "dspark" else [])
    return out.loss, list(torch.autograd.grad(out.loss, inputs))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_rows_change_nothing(name):
    config = LossConfig(top_k=TOP_K, depth_weights=WEIGHTS, rho=0.3, eta=2.0)
    b = make_batch(12)
    loss, grads = _run(name, b, config)
    hole = ~b.mask
    s = b.student_logits.detach().clone()
    s[hole] = float("nan")
    t = b.teacher_logits.clone()
    t[hole] = float("inf")
    c = b.confidence_logits.detach().masked_fill(hole, float("nan"))
    noisy = LossBatch(s.requires_grad_(), b.mask, t, b.labels.masked_fill(hole, 10**6), c.requires_grad_())
    loss2, grads2 = _run(name, noisy, config)
    assert torch.equal(loss, loss2)
    for g, g2 in zip(grads, grads2, strict=True):
        assert torch.equal(g, g2)
        assert (g2[hole] == 0).all()


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_fully_masked_batch_is_zero_with_grad(name):
    b = make_batch(13)
    empty = LossBatch(b.student_logits, torch.zeros(N, K, dtype=torch.bool), b.teacher_logits, b.labels,
                      b.confidence_logits)
    out = LOSSES[name](empty, LossConfig(top_k=TOP_K))
    assert out.loss.item() == 0.0 and out.loss.requires_grad
    out.loss.backward()
    assert (b.student_logits.grad == 0).all()


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_teacher_gets_no_gradient(name):
    b = make_batch(14)
    teacher = b.teacher_logits.clone().requires_grad_()
    batch = LossBatch(b.student_logits, b.mask, teacher, b.labels, b.confidence_logits)
    LOSSES[name](batch, LossConfig(top_k=TOP_K)).loss.backward()
    assert teacher.grad is None
    assert b.student_logits.grad is not None and b.student_logits.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_bf16_logits_are_computed_in_fp32(name):
    b = make_batch(15)
    s16, t16 = b.student_logits.detach().bfloat16(), b.teacher_logits.bfloat16()
    c = b.confidence_logits.detach().float()
    out16 = LOSSES[name](LossBatch(s16, b.mask, t16, b.labels, c), LossConfig())
    out32 = LOSSES[name](LossBatch(s16.float(), b.mask, t16.float(), b.labels, c), LossConfig())
    assert out16.loss.dtype == torch.float32
    assert torch.allclose(out16.loss, out32.loss, rtol=1e-6, atol=1e-7)


def test_registry_names_and_signature():
    assert set(LOSSES) == {"ce", "kl", "tv", "lk_lambda", "lk_alpha", "e2e_tv", "dpace_lk", "dspark"}
    b = make_batch(16)
    for name in LOSSES:
        out = get_loss(name)(b, LossConfig(top_k=TOP_K))
        assert isinstance(out, LossOutput) and out.loss.dim() == 0 and torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="unknown loss"):
        get_loss("nope")
    with pytest.raises(ValueError, match="teacher_logits"):
        LOSSES["kl"](LossBatch(b.student_logits, b.mask), LossConfig())
    with pytest.raises(ValueError, match="labels"):
        LOSSES["dpace_lk"](LossBatch(b.student_logits, b.mask, b.teacher_logits), LossConfig())


def test_loss_schedule_switches_at_step():
    b = make_batch(17)
    config = LossConfig(top_k=TOP_K)
    sched = LossSchedule(cold_start="lk_alpha", switch_step=3, config=config)
    assert [sched.name_at(s) for s in range(5)] == ["lk_alpha"] * 3 + ["e2e_tv"] * 2
    assert torch.equal(sched.loss(2, b).loss, lk_alpha_loss(b.student_logits, b.teacher_logits, b.mask,
                                                            top_k=TOP_K, eps=config.eps))
    assert torch.equal(sched.loss(3, b).loss, e2e_tv_loss(b.student_logits, b.teacher_logits, b.mask, TOP_K))
    assert LossSchedule(cold_start="dpace_lk", switch_step=0).name_at(0) == "e2e_tv"
    with pytest.raises(ValueError, match="unknown loss"):
        LossSchedule(cold_start="lk")
    with pytest.raises(ValueError, match="switch_step"):
        LossSchedule(switch_step=-1)


def test_depth_weight_normalisation():
    assert torch.allclose(normalize_depth_weights([1.0, 2.0, 1.0], 3), torch.tensor([0.25, 0.5, 0.25]))
    assert torch.allclose(normalize_depth_weights(None, 4), torch.full((4,), 0.25))
    b = make_batch(18)
    assert torch.allclose(forward_kl(b.student_logits, b.teacher_logits, b.mask, (4.0, 2.0, 1.0)),
                          forward_kl(b.student_logits, b.teacher_logits, b.mask, (4 / 7, 2 / 7, 1 / 7)), atol=1e-15)
    for bad in ([1.0, 2.0], [1.0, -1.0, 1.0], [0.0, 0.0, 0.0], [1.0, float("nan"), 1.0]):
        with pytest.raises(ValueError):
            normalize_depth_weights(bad, 3)


def test_bad_inputs_are_rejected():
    b = make_batch(19)
    with pytest.raises(ValueError, match="N, K, V"):
        forward_kl(b.student_logits[0], b.teacher_logits[0], b.mask[0])
    with pytest.raises(ValueError, match="bool"):
        tv_loss(b.student_logits, b.teacher_logits, b.mask.double())
    with pytest.raises(ValueError, match="must match"):
        tv_loss(b.student_logits, b.teacher_logits[:, :, :-1], b.mask)
    with pytest.raises(ValueError, match="labels"):
        cross_entropy(b.student_logits, b.labels.double(), b.mask)
    for bad in ({"top_k": 0}, {"rho": 1.5}, {"eps": 0.0}, {"gamma": 0.0}, {"eta": -1.0}, {"tv_coef": -0.1}):
        with pytest.raises(ValueError):
            LossConfig(**bad)
