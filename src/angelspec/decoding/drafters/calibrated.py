"""A drafter whose proposals carry STS-calibrated, sanitised confidences (`CalibratedDrafter`), and the loader hook
that wraps a drafter whose folder holds a `calibration.json` (`with_calibration`). The calibration math and the file
format are in `decoding/policies/sts.py`; this wrapper sits beside the drafters because the temperatures belong to
the drafter checkpoint, so every consumer of its proposals (depth policies, schedulers, reports) sees calibrated
confidences without further plumbing."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from angelspec.decoding.drafters.base import Drafter, DraftState, Proposal, WrappedDrafter
from angelspec.decoding.policies.base import sanitize_confidences
from angelspec.decoding.policies.sts import (
    CALIBRATION_FILE,
    CalibrationError,
    StsCalibration,
    StsCalibrationSet,
    apply_temperatures_to_confidences,
    load_calibration,
    temperatures_for,
)


class CalibratedDrafter(WrappedDrafter):
    """A drafter whose proposals carry calibrated, sanitised confidences; everything else is delegated. Each row
    uses the fit of the nearest fitted sampling temperature (`StsCalibrationSet`)."""

    def __init__(self, inner: Drafter, calibration: StsCalibration | StsCalibrationSet,
                 source: str | Path | None = None) -> None:
        super().__init__(inner)
        self.calibration = StsCalibrationSet.of(calibration)
        self.source = None if source is None else Path(source)
        self._bad: Tensor | None = None

    @property
    def name(self) -> str:
        return type(self.inner).__name__

    def propose(self, state: DraftState) -> Proposal:
        p = self.inner.propose(state)
        if p.confidences is None:
            raise CalibrationError(f"{self.source or 'the drafter folder'} holds {CALIBRATION_FILE}, but "
                                   f"{self.name} reports no confidences to calibrate; delete the file")
        # Sanitise the raw values first (that is where a bad value is the drafter's): c in [0, 1] keeps
        # c^(1/T) in [0, 1], so the calibrated confidences are clean too.
        conf, bad = sanitize_confidences(p.confidences)  # [B, K] float32, 0-dim count
        self._bad = bad if self._bad is None or self._bad.device != bad.device else self._bad + bad
        fits, k = self.calibration.fits, conf.shape[-1]
        if k > 0 and len(fits) == 1:
            conf = apply_temperatures_to_confidences(conf, temperatures_for(fits[0], k))
        elif k > 0:  # each row the fit of its request temperature
            conf = conf ** (1.0 / self.calibration.row_temperatures(state.sampling.temperature, k).to(conf.device))
        return Proposal(tokens=p.tokens, probs=p.probs, confidences=conf, lengths=p.lengths,
                        deterministic=p.deterministic, host_lengths=p.host_lengths)

    @property
    def bad_count(self) -> int:
        """Confidences replaced so far (NaN, inf, outside [0, 1]). Host sync: read it once per interval."""
        return 0 if self._bad is None else int(self._bad)

    def describe(self, temperature: float | None = None) -> str:
        """One line per fit; with the request `temperature`, the fit its rows use is marked."""
        where = f" from {self.source / CALIBRATION_FILE}" if self.source is not None else ""
        used = None if temperature is None else self.calibration.fit_for(temperature)
        lines = []
        for fit in self.calibration.fits:
            temps = ", ".join(f"{t:.2f}" for t in fit.temperatures)
            at = f" at sampling temperature {fit.sampling_temperature:g}" if len(self.calibration.fits) > 1 else ""
            mark = f" (used at temperature {temperature:g})" if fit is used and len(self.calibration.fits) > 1 else ""
            lines.append(f"calibrated confidences (STS{where}){at}: T_1..T_{len(fit.temperatures)} = [{temps}]{mark}")
        return "\n".join(lines)

    def temperature_note(self, temperature: float) -> str | None:
        """`StsCalibrationSet.temperature_note`: a note when `temperature` is far from every fit."""
        return self.calibration.temperature_note(temperature)


def with_calibration(drafter: Drafter, folder: str | Path) -> Drafter:
    """`drafter` wrapped in `CalibratedDrafter` when `folder` holds a calibration.json, else unchanged."""
    calibration = load_calibration(folder)
    return drafter if calibration is None else CalibratedDrafter(drafter, calibration, source=folder)
