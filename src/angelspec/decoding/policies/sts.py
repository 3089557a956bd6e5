"""Confidence calibration for the verification budgets: Sequential Temperature Scaling (STS) and the
Expected Calibration Error (ECE), as in the Uraion DSpark report (§3.2 and §4.x "Sequential Temperature
Scaling"; DSpark §3.2.1).

The schedulers (spec/budget.py) rank positions by prefix survival s_k = prod_{j<=k} c_j (AngelSpec Eq. 20,
Algorithm 1's a_{r,j}), so what must be calibrated is the *cumulative* product, not each c_k alone. STS fits
one temperature per draft position, left to right:

    k = 1..K:  a_k(T) = prod_{j<k} c_j^{1/T_j} * c_k^{1/T}       (earlier positions already calibrated)
               T_k = argmin_{T in grid} ECE(a_k(T), y_k)           (1-D grid search, 100 points in (0.1, 10))
    y_k = 1 iff drafts 1..k were all accepted (held-out verification outcomes).

The calibrated score is c~_k = c_k^{1/T_k} (the report's formula; T > 1 raises confidences, T < 1 lowers
them). For a confidence head c = sigmoid(z) this is exp(logsigmoid(z) / T): order-preserving, keeps 0 and 1
fixed, and differs from classic sigmoid(z / T) temperature scaling. Temperatures are stored as JSON next to
the drafter checkpoint (`calibration.json`) so the checkpoint directory stays self-describing.

Calibrated confidences for any drafter: `decoding/drafters/calibrated.py:CalibratedDrafter` wraps a drafter whose
folder holds a `calibration.json` (written by `angelspec calibrate`) so every consumer of its proposals (depth
policies, schedulers, reports) sees STS-calibrated confidences c_k^{1/T_k} without further plumbing.

Per sampling temperature: a draft's acceptance depends on the request's temperature (the confidence-driven policies
verify argmax drafts: at T = 0 greedily, at T > 0 with probability p_T(draft)), so one fit cannot serve every
temperature. `angelspec calibrate --temperature T` fits STS on runs at T and adds that fit to the file
(`StsCalibrationSet`, keyed by `sampling_temperature`; a fit at another temperature is kept). Each row of a step
uses the fit of the NEAREST fitted sampling temperature (ties to the lower one); a request more than
`MAX_FIT_DISTANCE` from every fit still uses the nearest fit, and the commands that know the request temperature
(`generate`, `eval`) print a note saying so (`CalibratedDrafter.temperature_note`). File format: one fit is written
as `{"method": "sts", "temperatures": [...], ..., "sampling_temperature": T}`, several as
`{"method": "sts", "fits": [one such object per temperature]}`; a file without `sampling_temperature` (every file
written before fits were keyed by temperature) is a fit at T = 0, where they were all made.

Why a drafter wrapper rather than `CalibratedPolicy`: the temperatures belong to the drafter checkpoint,
so loading the checkpoint is the one place that knows about them; `generate`, `eval` and any depth policy
then get them for free. The wrapper also sanitises the confidences with `policies.base.sanitize_confidences`
(NaN / -inf -> 0, +inf and > 1 -> 1, < 0 -> 0), so values outside [0, 1] never reach a scheduler even
through policies without their own guard (`ConfidenceThreshold`). Sanitising comes first (c in [0, 1] keeps
c^(1/T) in [0, 1]); the replaced raw entries are counted on the device (`bad_count` reads them: a host sync).

Shape legend: N held-out draft blocks, B batch rows, K draft positions, G grid points.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import DraftState, Proposal
from angelspec.decoding.policies.base import policy_static_depth, policy_uses_proposal
from angelspec.fileio import write_json_atomic

CALIBRATION_FILE = "calibration.json"
DEFAULT_NUM_BINS = 15  # the report's 15-bin ECE
MAX_FIT_DISTANCE = 0.25  # a request temperature farther than this from every fit gets a note (module docstring)


def temperature_grid(num: int = 100, lo: float = 0.1, hi: float = 10.0) -> Tensor:
    """[G] float64, log-spaced temperatures in [lo, hi] (the report's 100-point grid over (0.1, 10))."""
    return torch.logspace(math.log10(lo), math.log10(hi), num, dtype=torch.float64)


def ece(conf: Tensor, labels: Tensor, num_bins: int = DEFAULT_NUM_BINS) -> Tensor:
    """Expected Calibration Error with equal-width bins over [0, 1]: sum_b (n_b / N) |mean(y)_b - mean(c)_b|.

    conf [..., N] in [0, 1], labels [N] or [..., N] in {0, 1} -> ECE [...] (float64). Leading dims are
    independent problems (the STS grid search evaluates every temperature at once)."""
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    conf = conf.double()
    labels = labels.double().expand_as(conf)
    n = conf.shape[-1]
    if n == 0:
        raise ValueError("ECE of an empty set")
    lead = conf.shape[:-1]
    bins = (conf * num_bins).long().clamp(0, num_bins - 1)  # [..., N]; 1.0 falls into the last bin
    flat_bins = bins.reshape(-1, n)  # [P, N]
    sum_c = torch.zeros(flat_bins.shape[0], num_bins, dtype=torch.float64).scatter_add_(1, flat_bins,
                                                                                         conf.reshape(-1, n))
    sum_y = torch.zeros_like(sum_c).scatter_add_(1, flat_bins, labels.reshape(-1, n))
    # |sum_y - sum_c| / N = (n_b / N) |mean_y - mean_c|: no division by empty bins.
    return ((sum_y - sum_c).abs().sum(-1) / n).reshape(lead)


def survival_labels(accepted: Tensor) -> Tensor:
    """accepted [N, K] bool/0-1 per position -> y [N, K] float: y_k = 1 iff positions 1..k were accepted."""
    return torch.cumprod(accepted.double(), dim=-1)


def apply_temperatures(logits: Tensor, temperatures: Tensor | Sequence[float]) -> Tensor:
    """Raw confidence logits [..., K] -> calibrated confidences [..., K]: c~_k = sigmoid(z_k)^{1/T_k}
    computed as exp(logsigmoid(z_k) / T_k) (no underflow for very negative logits)."""
    t = _temps(temperatures, logits)
    return torch.exp(torch.nn.functional.logsigmoid(logits) / t)


def apply_temperatures_to_confidences(conf: Tensor, temperatures: Tensor | Sequence[float]) -> Tensor:
    """Confidences [..., K] in [0, 1] -> c^{1/T_k} [..., K] (for drafters that only report probabilities)."""
    t = _temps(temperatures, conf)
    return conf.clamp(0.0, 1.0) ** (1.0 / t)


def _temps(temperatures: Tensor | Sequence[float], like: Tensor) -> Tensor:
    t = torch.as_tensor(temperatures, dtype=like.dtype if like.is_floating_point() else torch.float64,
                        device=like.device)
    if t.dim() != 1 or t.shape[0] != like.shape[-1]:
        raise ValueError(f"need one temperature per position: {like.shape[-1]}, got {tuple(t.shape)}")
    if not bool((t > 0).all()):
        raise ValueError(f"temperatures must be > 0, got {t.tolist()}")
    return t


@dataclass(frozen=True)
class StsCalibration:
    """Per-position temperatures from `fit_sts` and the cumulative ECE per position before / after."""

    temperatures: tuple[float, ...]
    ece_before: tuple[float, ...] = ()
    ece_after: tuple[float, ...] = ()
    num_bins: int = DEFAULT_NUM_BINS
    sampling_temperature: float = 0.0  # the request temperature of the runs it was fitted on
    method: str = field(default="sts", init=False)

    def apply(self, logits: Tensor) -> Tensor:
        """Raw confidence logits [..., K] -> calibrated confidences [..., K]."""
        return apply_temperatures(logits, self.temperatures)

    def to_json(self) -> dict[str, object]:
        return {"method": self.method, "temperatures": list(self.temperatures), "num_bins": self.num_bins,
                "ece_before": list(self.ece_before), "ece_after": list(self.ece_after),
                "sampling_temperature": self.sampling_temperature}

    def save(self, checkpoint_dir: str | Path) -> Path:
        """Write `calibration.json` (this fit alone) into the drafter checkpoint directory; returns its path."""
        return StsCalibrationSet((self,)).save(checkpoint_dir)

    @classmethod
    def from_json(cls, obj: dict[str, object]) -> StsCalibration:
        if obj.get("method") != "sts":
            raise ValueError(f"unknown calibration method {obj.get('method')!r} (expected 'sts')")
        temps = tuple(float(t) for t in obj["temperatures"])  # type: ignore[union-attr]
        if not temps or any(not (math.isfinite(t) and t > 0) for t in temps):
            raise ValueError(f"calibration temperatures must be finite and > 0, got {list(temps)}")
        sampling = float(obj.get("sampling_temperature", 0.0))  # type: ignore[arg-type]  # absent: a T = 0 fit
        if not (math.isfinite(sampling) and sampling >= 0):
            raise ValueError(f"sampling_temperature must be finite and >= 0, got {sampling}")
        return cls(temperatures=temps, ece_before=tuple(obj.get("ece_before", ())),  # type: ignore[arg-type]
                   ece_after=tuple(obj.get("ece_after", ())),  # type: ignore[arg-type]
                   num_bins=int(obj.get("num_bins", DEFAULT_NUM_BINS)),  # type: ignore[arg-type]
                   sampling_temperature=sampling)

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> StsCalibration | None:
        """The calibration stored next to a drafter checkpoint, or None when there is none."""
        path = Path(checkpoint_dir) / CALIBRATION_FILE
        if not path.exists():
            return None
        return cls.from_json(json.loads(path.read_text()))


@dataclass(frozen=True)
class StsCalibrationSet:
    """A drafter's STS fits, one per sampling temperature they were fitted at (ascending, distinct); each row of a
    step uses the nearest one (module docstring)."""

    fits: tuple[StsCalibration, ...]

    def __post_init__(self) -> None:
        fits = tuple(sorted(self.fits, key=lambda f: f.sampling_temperature))
        temps = [f.sampling_temperature for f in fits]
        if not fits or len(set(temps)) != len(temps):
            raise ValueError(f"a calibration needs one fit per sampling temperature, got temperatures {temps}")
        object.__setattr__(self, "fits", fits)

    @property
    def sampling_temperatures(self) -> tuple[float, ...]:
        return tuple(f.sampling_temperature for f in self.fits)

    def fit_for(self, temperature: float) -> StsCalibration:
        """The fit of the nearest fitted sampling temperature (ties: the lower one)."""
        return min(self.fits, key=lambda f: abs(f.sampling_temperature - temperature))

    def with_fit(self, fit: StsCalibration) -> StsCalibrationSet:
        """These fits with `fit` added, replacing the one at its sampling temperature."""
        others = [f for f in self.fits if f.sampling_temperature != fit.sampling_temperature]
        return StsCalibrationSet((*others, fit))

    def temperature_note(self, temperature: float) -> str | None:
        """A note when requests at `temperature` are served by a fit more than MAX_FIT_DISTANCE away, else None."""
        nearest = self.fit_for(temperature).sampling_temperature
        if abs(nearest - temperature) <= MAX_FIT_DISTANCE:
            return None
        fitted = ", ".join(f"{t:g}" for t in self.sampling_temperatures)
        return (f"note: the drafter's confidences are calibrated at temperature {fitted}; requests at "
                f"{temperature:g} use the fit at {nearest:g}. Fit one at {temperature:g} with `angelspec calibrate "
                f"--temperature {temperature:g}`")

    def row_temperatures(self, sampling_temperature: Tensor, k: int) -> Tensor:
        """Per-row STS temperatures: the rows' request temperatures [B] -> [B, K] float32 on their device, each
        row the K temperatures (`temperatures_for`) of its nearest fit. On the device: no host sync."""
        dev = sampling_temperature.device
        table = torch.tensor([temperatures_for(f, k) for f in self.fits], dtype=torch.float32, device=dev)  # [F, K]
        fitted = torch.tensor(self.sampling_temperatures, dtype=torch.float32, device=dev)  # [F] ascending
        nearest = (sampling_temperature.float()[:, None] - fitted).abs().argmin(dim=1)  # [B], first = lower on ties
        return table[nearest]

    def to_json(self) -> dict[str, object]:
        """One fit in the single-fit form every reader knows; several under "fits"."""
        if len(self.fits) == 1:
            return self.fits[0].to_json()
        return {"method": "sts", "fits": [f.to_json() for f in self.fits]}

    def save(self, checkpoint_dir: str | Path) -> Path:
        """Write `calibration.json` into the drafter checkpoint directory; returns its path."""
        path = Path(checkpoint_dir) / CALIBRATION_FILE
        write_json_atomic(path, self.to_json())
        return path

    @classmethod
    def from_json(cls, obj: dict[str, object]) -> StsCalibrationSet:
        if "fits" not in obj:
            return cls((StsCalibration.from_json(obj),))
        if obj.get("method") != "sts" or not isinstance(obj["fits"], list):
            raise ValueError(f"expected {{'method': 'sts', 'fits': [...]}}, got method {obj.get('method')!r}")
        return cls(tuple(StsCalibration.from_json(f) for f in obj["fits"]))

    @classmethod
    def of(cls, calibration: StsCalibration | StsCalibrationSet) -> StsCalibrationSet:
        return calibration if isinstance(calibration, StsCalibrationSet) else cls((calibration,))


def cumulative_ece(conf: Tensor, accepted: Tensor, num_bins: int = DEFAULT_NUM_BINS) -> list[float]:
    """ECE of the prefix survival prod_{j<=k} c_j against y_k, per position k. conf, accepted [N, K]."""
    s = torch.cumprod(conf.double(), dim=-1)  # [N, K]
    y = survival_labels(accepted)
    return [float(ece(s[:, k], y[:, k], num_bins)) for k in range(conf.shape[1])]


def fit_sts(logits: Tensor, accepted: Tensor, *, grid: Tensor | None = None,
            num_bins: int = DEFAULT_NUM_BINS) -> StsCalibration:
    """Sequential Temperature Scaling on held-out blocks: logits [N, K] raw confidence logits, accepted
    [N, K] per-position verification outcomes (positions after the first rejection may hold anything: the
    cumulative label masks them). Left to right, T_k minimises the ECE of prod_{j<k} c~_j * c_k^{1/T}
    against y_k over `grid` [G] (default: 100 log-spaced points in [0.1, 10]); ties go to the first grid
    point. Rows with a non-finite logit are dropped."""
    if logits.dim() != 2 or logits.shape != accepted.shape:
        raise ValueError(f"fit_sts wants logits and accepted [N, K] of one shape, got {tuple(logits.shape)}, "
                         f"{tuple(accepted.shape)}")
    ok = torch.isfinite(logits).all(dim=-1)
    logits, accepted = logits[ok].double(), accepted[ok]
    if logits.shape[0] == 0:
        raise ValueError("fit_sts needs at least one block with finite logits")
    grid = temperature_grid() if grid is None else grid.double()
    log_c = torch.nn.functional.logsigmoid(logits)  # [N, K]
    y = survival_labels(accepted)  # [N, K]
    prefix = torch.zeros(logits.shape[0], dtype=torch.float64)  # [N] log prod_{j<k} c~_j
    temps = []
    for k in range(logits.shape[1]):
        cand = torch.exp(prefix[None, :] + log_c[None, :, k] / grid[:, None])  # [G, N]
        errors = ece(cand, y[:, k], num_bins)  # [G]
        t = float(grid[int(torch.argmin(errors))])
        temps.append(t)
        prefix = prefix + log_c[:, k] / t
    before = cumulative_ece(torch.exp(log_c), accepted, num_bins)
    after = cumulative_ece(apply_temperatures(logits, temps), accepted, num_bins)
    return StsCalibration(temperatures=tuple(temps), ece_before=tuple(before), ece_after=tuple(after),
                          num_bins=num_bins)


class CalibratedPolicy:
    """Wraps a depth policy so that it sees calibrated confidences c_k^{1/T_k} (proposal.confidences are
    probabilities). Only confidences change, so `uses_proposal` / `static_depth` are the wrapped policy's.
    Positions beyond the calibrated ones reuse the last temperature."""

    def __init__(self, policy: object, calibration: StsCalibration) -> None:
        self.policy, self.calibration = policy, calibration

    @property
    def uses_proposal(self) -> bool:
        return policy_uses_proposal(self.policy)  # type: ignore[arg-type]

    @property
    def static_depth(self) -> int | None:
        return policy_static_depth(self.policy)  # type: ignore[arg-type]

    def __call__(self, proposal: Proposal, state: DraftState) -> Tensor:
        c = proposal.confidences
        if c is not None and c.shape[-1] > 0:
            temps = list(self.calibration.temperatures[: c.shape[-1]])
            temps += [temps[-1]] * (c.shape[-1] - len(temps))
            # NaN stays NaN here: the budget policies' guard replaces and counts it.
            c = apply_temperatures_to_confidences(c.float(), temps)
            proposal = Proposal(tokens=proposal.tokens, probs=proposal.probs, confidences=c,
                                lengths=proposal.lengths, deterministic=proposal.deterministic)
        return self.policy(proposal, state)  # type: ignore[operator]


class CalibrationError(ValueError):
    """A calibration file that cannot be used, or a drafter that cannot be calibrated."""


def load_calibration(folder: str | Path) -> StsCalibrationSet | None:
    """The fits in a drafter folder's `calibration.json`, None when there is none; a broken file is a clear error."""
    path = Path(folder) / CALIBRATION_FILE
    if not path.exists():
        return None
    try:
        return StsCalibrationSet.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise CalibrationError(f"{path} is not a usable calibration ({type(e).__name__}: {e}); re-run "
                               f"`angelspec calibrate --force` or delete it") from None


def temperatures_for(calibration: StsCalibration, k: int) -> list[float]:
    """K temperatures: the first K fitted ones, the last one repeated when K exceeds the fitted depth."""
    temps = list(calibration.temperatures[:k])
    return temps + [temps[-1]] * (k - len(temps))
