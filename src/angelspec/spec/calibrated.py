"""Calibrated confidences for any drafter: `CalibratedDrafter` wraps a drafter whose folder holds a
`calibration.json` (written by `angelspec calibrate`) so every consumer of its proposals (depth policies,
schedulers, reports) sees STS-calibrated confidences c_k^{1/T_k} without further plumbing.

Why a drafter wrapper rather than `CalibratedPolicy`: the temperatures belong to the drafter checkpoint,
so loading the checkpoint is the one place that knows about them; `generate`, `eval` and any depth policy
then get them for free. The confidences are also sanitised here with `drafter.sanitize_confidences`
(NaN / -inf -> 0, +inf and > 1 -> 1, < 0 -> 0), so values outside [0, 1] never reach a scheduler even
through policies without their own guard (`ConfidenceThreshold`). Sanitising comes first (c in [0, 1] keeps
c^(1/T) in [0, 1]); the replaced raw entries are counted on the device (`bad_count` reads them: a host sync).

Shape legend: B batch rows, K draft depth.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from angelspec.models.config import DecoderConfig
from angelspec.spec.calibration import CALIBRATION_FILE, StsCalibration, apply_temperatures_to_confidences
from angelspec.spec.drafter import Commit, Drafter, DraftState, Proposal, sanitize_confidences


class CalibrationError(ValueError):
    """A calibration file that cannot be used, or a drafter that cannot be calibrated."""


def load_calibration(folder: str | Path) -> StsCalibration | None:
    """The `calibration.json` in a drafter folder, None when there is none; a broken file is a clear error."""
    path = Path(folder) / CALIBRATION_FILE
    try:
        return StsCalibration.load(folder)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise CalibrationError(f"{path} is not a usable calibration ({type(e).__name__}: {e}); re-run "
                               f"`angelspec calibrate --force` or delete it") from None


def temperatures_for(calibration: StsCalibration, k: int) -> list[float]:
    """K temperatures: the first K fitted ones, the last one repeated when K exceeds the fitted depth."""
    temps = list(calibration.temperatures[:k])
    return temps + [temps[-1]] * (k - len(temps))


class CalibratedDrafter(Drafter):
    """A drafter whose proposals carry calibrated, sanitised confidences; everything else is delegated."""

    def __init__(self, inner: Drafter, calibration: StsCalibration, source: str | Path | None = None) -> None:
        self.inner, self.calibration = inner, calibration
        self.source = None if source is None else Path(source)
        self.target_layer_ids = inner.target_layer_ids
        self._bad: Tensor | None = None

    @property
    def name(self) -> str:
        return type(self.inner).__name__

    @property
    def vocab_size(self) -> int | None:
        return self.inner.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...] | None:
        return self.inner.eos_token_ids

    @property
    def target_fingerprint(self) -> str | None:
        return self.inner.target_fingerprint

    @property
    def max_positions(self) -> int | None:
        return self.inner.max_positions

    def check_compatible(self, target: DecoderConfig, max_seq_len: int | None = None) -> None:
        self.inner.check_compatible(target, max_seq_len)

    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:
        self.inner.allocate(batch_size, max_len, device=device, slack=slack)

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                target_hidden: tuple[Tensor, ...]) -> None:
        self.inner.prefill(rows, prompts, first_tokens, target_hidden)

    def propose(self, state: DraftState) -> Proposal:
        p = self.inner.propose(state)
        if p.confidences is None:
            raise CalibrationError(f"{self.source or 'the drafter folder'} holds {CALIBRATION_FILE}, but "
                                   f"{self.name} reports no confidences to calibrate; delete the file")
        # Sanitise the raw values first (that is where a bad value is the drafter's): c in [0, 1] keeps
        # c^(1/T) in [0, 1], so the calibrated confidences are clean too.
        conf, bad = sanitize_confidences(p.confidences)  # [B, K] float32, 0-dim count
        self._bad = bad if self._bad is None or self._bad.device != bad.device else self._bad + bad
        if conf.shape[-1] > 0:
            conf = apply_temperatures_to_confidences(conf, temperatures_for(self.calibration, conf.shape[-1]))
        return Proposal(tokens=p.tokens, probs=p.probs, confidences=conf, lengths=p.lengths,
                        deterministic=p.deterministic)

    def on_commit(self, commit: Commit) -> None:
        self.inner.on_commit(commit)

    def reset_rows(self, rows: Sequence[int]) -> None:
        self.inner.reset_rows(rows)

    def compile(self) -> None:
        self.inner.ensure_compiled()  # the wrapped drafter's hot calls; the calibration itself is a few ops

    @property
    def bad_count(self) -> int:
        """Confidences replaced so far (NaN, inf, outside [0, 1]). Host sync: read it once per interval."""
        return 0 if self._bad is None else int(self._bad)

    def describe(self) -> str:
        temps = ", ".join(f"{t:.2f}" for t in self.calibration.temperatures)
        where = f" from {self.source / CALIBRATION_FILE}" if self.source is not None else ""
        return f"calibrated confidences (STS{where}): T_1..T_{len(self.calibration.temperatures)} = [{temps}]"


def with_calibration(drafter: Drafter, folder: str | Path) -> Drafter:
    """`drafter` wrapped in `CalibratedDrafter` when `folder` holds a calibration.json, else unchanged."""
    calibration = load_calibration(folder)
    return drafter if calibration is None else CalibratedDrafter(drafter, calibration, source=folder)
