"""The sequential heads of the block drafters (Eq. 13–15, DSpark §3.1) and the confidence head (DSpark §3.2).

After the parallel backbone, only a small head runs left to right over the B−1 draft positions (Eq. 13). With
z_k the backbone output at block entry k (pre-norm), h_k = RMSNorm(z_k), U_k = W_lm h_k and x_{k−1} the
predecessor (the anchor for k = 1, then the previous draft; the clean token in teacher-forced training):

    none     q_k = softmax(U_k)                                            (DFlash)
    markov   Eq. 14   q_k = softmax(U_k + W2 W1[x_{k−1}])                 (W1 [V, r], W2 [r, V]: rank r)
    gated    DSpark   q_k = softmax(U_k + W2 (σ(W_g [h_k; W1[x_{k−1}]]) ⊙ W1[x_{k−1}]))
    rnn      DSpark   ζ_k = [s_{k−1}; W1[x_{k−1}]; h_k],  s_k = σ(W_g ζ_k) ⊙ s_{k−1} + (1−σ(W_g ζ_k)) ⊙ tanh(W_c ζ_k),
                      q_k = softmax(U_k + W2 tanh(W_o ζ_k)),  s_0 = 0
    hidden   Eq. 15   ẑ_k = z_k + SwiGLU([RMSNorm(z_k); RMSNorm(E(x_{k−1}))]),  q_k = softmax(W_lm RMSNorm(ẑ_k))

and the optional confidence head (DSpark §3.2) `c_k = σ(w·[h_k; W1[x_{k−1}]] + b)` predicts the acceptance of draft
k; it shares W1 with a Markov-family head and owns a rank-r W1 otherwise. With `confidence_target` "tv" (DSpark's
recipe, and every folder written before the option existed) it has one output, trained on α = 1 − TV(p_k, q_k).
With "protocol" it has one output per sampling temperature T_j of a small grid (w_j, b_j: `proj` has n outputs),
trained on the acceptance of the argmax draft that the confidence-driven policies verify (1[argmax q = argmax p]
at T = 0, p_T(argmax q) at T > 0), and a row decoding at temperature T reads the piecewise-linear interpolation of
the logits of the two grid points around T (`temperature_weights`; outside the grid, the nearest end point's).
W2 and the SwiGLU's down projection start at zero (`BlockDrafter` zeroes them), so every head starts as the plain
backbone.

Shape legend: C model dim, V vocab, r rank, I the hidden-correction SwiGLU width, K = B−1 draft positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from angelspec.models.decoder import RMSNorm
from angelspec.models.linear import Linear, linear


class MarkovHead(nn.Module):
    """Eq. 14: bias b = W2 W1[x_prev], a rank-r first-order transition added to the backbone logits."""

    stateful = False

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)  # W1 [V, r]
        self.out = Linear(rank, vocab_size, bias=False)  # W2 [r, V] (stored transposed, as nn.Linear does)

    def init_state(self, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
        return None

    def step(self, h: Tensor, prev: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """h [..., C] (normalised backbone state), prev [...] -> (bias [..., V], next state)."""
        u, state = self.features(h, prev, state)
        return self.out(u), state

    def features(self, h: Tensor, prev: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The rank-r vector W2 maps to the bias: h [..., C], prev [...] -> (u [..., r], next state)."""
        return self.embed(prev), None

    def sequence(self, h: Tensor, prev: Tensor) -> Tensor:
        """Teacher-forced biases for a whole block: h [..., K, C], prev [..., K] -> [..., K, V]. Stateless heads
        are position-wise, so every position runs at once; the RNN loops over K (small)."""
        return self.out(self.sequence_features(h, prev))

    def sequence_features(self, h: Tensor, prev: Tensor) -> Tensor:
        """`features` over a whole block: h [..., K, C], prev [..., K] -> u [..., K, r]."""
        if not self.stateful:
            return self.features(h, prev, None)[0]
        state = self.init_state(prev.shape[:-1], h)
        out = []
        for k in range(prev.shape[-1]):
            u, state = self.features(h[..., k, :], prev[..., k], state)
            out.append(u)
        return torch.stack(out, dim=-2)


class GatedMarkovHead(MarkovHead):
    """DSpark §3.1: g = σ(W_g [h; W1[x_prev]]), b = W2 (g ⊙ W1[x_prev])."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__(vocab_size, hidden_size, rank)
        self.gate = Linear(hidden_size + rank, rank)  # W_g

    def features(self, h: Tensor, prev: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        e = self.embed(prev).to(h.dtype)  # [..., r]
        g = torch.sigmoid(self.gate(torch.cat([h, e], dim=-1)))
        return g * e, None


class RNNHead(MarkovHead):
    """DSpark §3.1, a GRU-like head over the realised prefix: ζ_k = [s_{k−1}; W1[x_{k−1}]; h_k],
    s_k = σ(W_g ζ_k) ⊙ s_{k−1} + (1 − σ(W_g ζ_k)) ⊙ tanh(W_c ζ_k), b_k = W2 tanh(W_o ζ_k); s_0 = 0, state dim r."""

    stateful = True

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__(vocab_size, hidden_size, rank)
        self.rank = rank
        width = 2 * rank + hidden_size
        self.gate = Linear(width, rank)  # W_g
        self.cand = Linear(width, rank)  # W_c
        self.proj = Linear(width, rank)  # W_o

    def init_state(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        return like.new_zeros(*shape, self.rank)

    def features(self, h: Tensor, prev: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        assert state is not None
        zeta = torch.cat([state, self.embed(prev).to(h.dtype), h], dim=-1)  # [..., 2r + C]
        u = torch.sigmoid(self.gate(zeta))
        new_state = u * state + (1 - u) * torch.tanh(self.cand(zeta))
        return torch.tanh(self.proj(zeta)), new_state


class HiddenCorrectionHead(nn.Module):
    """Eq. 15: ẑ = z + SwiGLU([RMSNorm(z); RMSNorm(e_prev)]) with e_prev the target embedding of the predecessor.
    The down projection starts at zero, so the head starts as the identity.

    The gate/up projection of the concatenation is W [RMSNorm z; RMSNorm e] = W_z RMSNorm z + W_e RMSNorm e, so the
    predecessor-free half (`z_part`) runs for a whole block at once and a left-to-right step (`step`) multiplies
    only W_e: half the weights per draft position."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float) -> None:
        super().__init__()
        self.hidden = hidden_size
        self.inter = intermediate_size
        self.z_norm = RMSNorm(hidden_size, eps)
        self.e_norm = RMSNorm(hidden_size, eps)
        self.gate_up_proj = Linear(2 * hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def z_part(self, z: Tensor) -> Tensor:
        """W_z RMSNorm(z): z [..., C] backbone output (pre-norm) -> [..., 2I]."""
        return linear(self.z_norm(z), self.gate_up_proj.weight[:, : self.hidden])

    def step(self, z: Tensor, z_part: Tensor, e_prev: Tensor) -> Tensor:
        """ẑ from z [..., C], its `z_part` [..., 2I] and e_prev [..., C] -> [..., C]."""
        gate_up = z_part + linear(self.e_norm(e_prev.to(z.dtype)), self.gate_up_proj.weight[:, self.hidden:])
        gate, up = gate_up.split(self.inter, dim=-1)
        return z + self.down_proj(F.silu(gate) * up)

    def forward(self, z: Tensor, e_prev: Tensor) -> Tensor:
        """z [..., C] backbone output (pre-norm), e_prev [..., C] -> ẑ [..., C]."""
        return self.step(z, self.z_part(z), e_prev)


def temperature_weights(temperature: Tensor, grid: Sequence[float]) -> Tensor:
    """Piecewise-linear interpolation weights over a strictly increasing temperature `grid` (n points): sampling
    temperatures [...] -> [..., n] float32, summing to 1. A temperature between two grid points splits the weight
    between them linearly; one outside the grid is clamped to it (all weight on the nearest end point). Elementwise
    only, so it compiles into the greedy draft step."""
    g = torch.tensor([float(t) for t in grid], dtype=torch.float32, device=temperature.device)  # [n]
    t = temperature.float()[..., None].clamp(float(grid[0]), float(grid[-1]))  # [..., 1]
    if g.numel() == 1:
        return torch.ones_like(t)
    left = torch.cat([g[:1] - 1.0, g[:-1]])  # the previous grid point (a dummy one below the first)
    right = torch.cat([g[1:], g[-1:] + 1.0])  # the next grid point (a dummy one above the last)
    return torch.minimum((t - left) / (g - left), (right - t) / (right - g)).clamp(0.0, 1.0)  # hat functions


class ConfidenceHead(nn.Module):
    """DSpark §3.2: confidence logit w·[h_k; W1[x_{k−1}]] + b (sigmoid -> c_k). `temperatures` empty: one output,
    trained on α = 1 − TV ("tv"); else one output per sampling temperature of the grid ("protocol", module
    docstring)."""

    def __init__(self, hidden_size: int, rank: int, temperatures: Sequence[float] = ()) -> None:
        super().__init__()
        self.temperatures = tuple(float(t) for t in temperatures)
        self.proj = Linear(hidden_size + rank, max(1, len(self.temperatures)))

    def all_logits(self, h: Tensor, e: Tensor) -> Tensor:
        """h [..., C], e = W1[x_prev] [..., r] -> logits [..., n] (pre-sigmoid), one per grid temperature."""
        return self.proj(torch.cat([h, e.to(h.dtype)], dim=-1))

    def training_logits(self, h: Tensor, e: Tensor) -> Tensor:
        """What the trainer fits: logits [...] of the "tv" head, [..., n] (one per grid temperature) of a
        "protocol" head."""
        out = self.all_logits(h, e)
        return out if self.temperatures else out[..., 0]

    def forward(self, h: Tensor, e: Tensor, temperature: Tensor | None = None) -> Tensor:
        """h [..., C], e = W1[x_prev] [..., r], temperature: the rows' sampling temperatures, broadcastable to
        [...] (None = 0, greedy; the "tv" head ignores it) -> logits [...] (pre-sigmoid)."""
        out = self.all_logits(h, e)
        if len(self.temperatures) <= 1:
            return out[..., 0]
        t = torch.zeros((), device=out.device) if temperature is None else temperature
        return (out.float() * temperature_weights(t, self.temperatures)).sum(-1)


HEAD_CLASSES: dict[str, type[MarkovHead]] = {"markov": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead}
