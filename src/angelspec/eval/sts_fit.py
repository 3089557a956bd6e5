"""Fitting a drafter's STS temperatures on held-out runs (the code behind `angelspec calibrate`): decode held-out
prompts, record each draft position's confidence and whether it was accepted, fit Sequential Temperature Scaling
(`fit_sts`, decoding/policies/sts.py, Uraion DSpark report §3.2), print the ECE per position before and after,
and write calibration.json next to the drafter, where `CalibratedDrafter` applies it on load.

The drafter decodes held-out prompts at full depth (every row verifies all K drafts, so the outcome of every
position is observed) at one sampling temperature T (`--temperature`, default 0), with the protocol the
confidence-driven policies use: argmax drafts, verified greedily at T = 0 and with the deterministic-draft protocol
at T > 0 (accepted with probability p_T(draft)). The fit is stored as the drafter's fit at T, beside the fits at
other temperatures (`StsCalibrationSet`); each request uses the nearest one. The engine's `on_verify` hook hands
each step's proposal and accepted counts to a `ConfidenceRecorder`, which keeps per active row:

    logits [K]   z_k = log(c_k / (1 - c_k)) of the drafter's raw confidence, c clipped to [eps, 1 - eps]
    accepted [K] 1 for the accepted prefix (positions < num_accepted), 0 from the first rejection on

A row counts only when every position's outcome is known: it verified all K drafts, or it saw a
rejection (positions past a rejection are 0 whatever the drafter would have said). Confidences that are
NaN or outside [0, 1] make the row's logits NaN, which `fit_sts` drops, and are counted in the report.

Shape legend: B batch rows, K draft depth, N recorded draft blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import Drafter, full_depth_drafting
from angelspec.decoding.drafters.calibrated import CalibratedDrafter
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, VerifyEvent
from angelspec.decoding.loading import drafter_path
from angelspec.decoding.policies.base import FixedDepth
from angelspec.decoding.policies.sts import (
    CALIBRATION_FILE,
    CalibrationError,
    StsCalibration,
    StsCalibrationSet,
    fit_sts,
    load_calibration,
    survival_labels,
)
from angelspec.decoding.sampling import SamplingParams
from angelspec.fileio import check_writable_path
from angelspec.models.decoder import Decoder

LOGIT_EPS = 1e-6  # confidences are clipped to [eps, 1 - eps] before the logit: |z| <= 13.8


def confidence_logits(conf: Tensor, eps: float = LOGIT_EPS) -> Tensor:
    """conf [..., K] probabilities -> logits [..., K] float64; NaN where conf is NaN or outside [0, 1]."""
    c = conf.double()
    valid = (c >= 0) & (c <= 1)  # NaN fails both
    p = c.clamp(eps, 1 - eps)
    return torch.where(valid, torch.log(p) - torch.log1p(-p), math.nan)


class ConfidenceRecorder:
    """`SpecEngine(on_verify=...)` observer collecting (confidence logits, accepted) per observed draft block.

    `name` names the drafter in the error raised when its proposals carry no confidences."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._logits: list[Tensor] = []
        self._accepted: list[Tensor] = []
        self.unobserved = 0  # active rows skipped: they verified fewer than K drafts and accepted all of them

    def __call__(self, event: VerifyEvent) -> None:
        conf = event.proposal.confidences
        if conf is None:
            raise CalibrationError(f"drafter {self.name} reports no confidences, so there is nothing to calibrate "
                                   "(calibration needs a drafter with per-position confidences)")
        k = conf.shape[1]
        acc, depth, active = event.num_accepted, event.depth, event.active  # [B] each
        observed = active & ((acc < depth) | (depth == k))  # [B] every position's outcome known
        positions = torch.arange(k, device=conf.device)
        accepted = positions[None, :] < acc[:, None]  # [B, K] the accepted prefix
        # Host copies: one per step, acceptable for an offline calibration run.
        self.unobserved += int((active & ~observed).sum())
        self._logits.append(confidence_logits(conf[observed]).cpu())
        self._accepted.append(accepted[observed].cpu())

    def tensors(self) -> tuple[Tensor, Tensor]:
        """(logits [N, K] float64, accepted [N, K] bool) over every recorded block."""
        if not self._logits or sum(t.shape[0] for t in self._logits) == 0:
            raise CalibrationError(f"no draft block of {self.name} was observed; use more prompts or more "
                                   "--max-new-tokens")
        return torch.cat(self._logits), torch.cat(self._accepted)


def drafter_folder(spec: str) -> Path:
    """The checkpoint folder of a `--drafter DIR` or `KIND:DIR` spec; calibration needs a saved drafter."""
    folder = drafter_path(spec)
    if not folder.is_dir():
        raise CalibrationError(f"--drafter {spec!r}: calibration writes {CALIBRATION_FILE} next to the drafter "
                               "checkpoint, so it needs a drafter folder (DIR or KIND:DIR), and "
                               f"{folder} is not a folder")
    return folder


def check_writable(folder: Path, force: bool, temperature: float = 0.0) -> Path:
    """Where the calibration goes; refuses, before anything is decoded and without `force`, to overwrite a fit at
    `temperature` (fits at other temperatures are kept and need no `force`) or a file it cannot read."""
    path = folder / CALIBRATION_FILE
    check_writable_path(path, "--drafter")  # a read-only folder fails now, not after the decoding
    if path.exists() and not force:
        existing = load_calibration(folder)  # a broken file: a clear CalibrationError
        if existing is not None and temperature in existing.sampling_temperatures:
            raise FileExistsError(f"{path} already exists; pass --force to re-calibrate and overwrite its fit at "
                                  f"temperature {temperature:g} (fits at other temperatures are kept)")
    return path


def collect_outcomes(target: Decoder, drafter: Drafter, prompt_ids: Sequence[Sequence[int]], *, name: str,
                     max_new_tokens: int, num_draft_tokens: int, batch_size: int, temperature: float = 0.0,
                     progress: bool = False) -> ConfidenceRecorder:
    """Decode the prompts at full depth and sampling `temperature` (request i with seed i) with the drafter's RAW
    confidences (a `CalibratedDrafter` is unwrapped, so re-calibrating does not fit on top of an older
    calibration), verifying argmax drafts as the confidence-driven policies make the engine do (a full-depth policy
    that declares `uses_proposal`); returns the recorder.
    A drafter that ends proposals early on low confidence (the draft LM's `stop_below`) drafts all K here:
    a block it would have cut short and then seen fully accepted tells nothing about its later positions."""
    raw = drafter.inner if isinstance(drafter, CalibratedDrafter) else drafter
    if not prompt_ids:
        raise CalibrationError("no prompts to calibrate on")
    context = target.config.max_position_embeddings
    longest = max(len(ids) for ids in prompt_ids)
    recorder = ConfidenceRecorder(name)
    engine = SpecEngine(target, raw, EngineConfig(max_batch_size=batch_size, num_draft_tokens=num_draft_tokens,
                                                  max_seq_len=max(2, min(context, longest + max_new_tokens))),
                        depth_policy=FixedDepth(uses_proposal=True), on_verify=recorder)
    sampling = [SamplingParams() if temperature == 0 else SamplingParams(temperature=temperature, seed=i)
                for i in range(len(prompt_ids))]
    requests = [Request(prompt_ids=list(ids), max_new_tokens=min(max_new_tokens, context - len(ids)),
                        sampling=sampling[i], request_id=i) for i, ids in enumerate(prompt_ids)]
    with full_depth_drafting(raw):
        engine.generate(requests, progress=progress)
    return recorder


def format_calibration(cal: StsCalibration, accepted: Tensor, *, name: str, dropped: int, unobserved: int) -> str:
    """ECE of the prefix survival per position, before and after, with the fitted temperature.
    accepted [N, K]: the blocks the fit used."""
    rate = survival_labels(accepted).mean(dim=0).tolist()  # [K] share of blocks whose prefix 1..k survived
    lines = [f"calibrated {name} at sampling temperature {cal.sampling_temperature:g} on {accepted.shape[0]} draft "
             f"blocks, K={accepted.shape[1]} "
             f"({dropped} with invalid confidences dropped, {unobserved} rows not fully observed skipped)",
             f"{'position':>8}{'ECE before':>12}{'ECE after':>11}{'T':>8}{'survival':>10}"]
    for k, (b, a, t) in enumerate(zip(cal.ece_before, cal.ece_after, cal.temperatures, strict=True)):
        lines.append(f"{k + 1:>8}{b:>12.4f}{a:>11.4f}{t:>8.2f}{rate[k]:>10.3f}")
    mean_b, mean_a = sum(cal.ece_before) / len(cal.ece_before), sum(cal.ece_after) / len(cal.ece_after)
    lines.append(f"{'mean':>8}{mean_b:>12.4f}{mean_a:>11.4f}")
    return "\n".join(lines)


def calibrate_drafter(target: Decoder, drafter: Drafter, prompt_ids: Sequence[Sequence[int]], folder: Path, *,
                      name: str, max_new_tokens: int = 64, num_draft_tokens: int = 4, batch_size: int = 8,
                      temperature: float = 0.0, force: bool = False, progress: bool = False) -> str:
    """Collect outcomes at sampling `temperature`, fit STS, store the fit as the one at that temperature in
    `folder/calibration.json` (the fits at other temperatures are kept; an unreadable file is replaced under
    `force`); returns the printed report."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise CalibrationError(f"--temperature must be a number >= 0, got {temperature}")
    path = check_writable(folder, force, temperature)
    recorder = collect_outcomes(target, drafter, prompt_ids, name=name, max_new_tokens=max_new_tokens,
                                num_draft_tokens=num_draft_tokens, batch_size=batch_size, temperature=temperature,
                                progress=progress)
    logits, accepted = recorder.tensors()
    ok = torch.isfinite(logits).all(dim=-1)
    if not bool(ok.any()):
        raise CalibrationError(f"every confidence {name} reported was NaN or outside [0, 1]; nothing to fit")
    cal = replace(fit_sts(logits, accepted), sampling_temperature=float(temperature))  # drops non-finite rows itself
    try:
        existing = load_calibration(folder)
    except CalibrationError:  # unreadable: only reached under --force (check_writable)
        existing = None
    (StsCalibrationSet((cal,)) if existing is None else existing.with_fit(cal)).save(folder)
    report = format_calibration(cal, accepted[ok], name=name, dropped=int((~ok).sum()),
                                unobserved=recorder.unobserved)
    return f"{report}\nwrote {path}"
