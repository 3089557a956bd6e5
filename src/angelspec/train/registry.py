"""The drafter kinds `angelspec train` can train, and where their trainers live.

Every trainer module has `PRESETS` (name -> config) and an entry point with one signature, `train.config.Trainer`:
`train_X(target_dir, data, out_dir, *, config, resume, force, ...)`; `get_trainer(kind)` imports the module on
first use (a trainer pulls in torch and the data pipeline, which `angelspec --help` does not need).
"""

from __future__ import annotations

import importlib
from typing import Any

from angelspec.train.config import Trainer

# Drafter kind -> (trainer module, its `Trainer` entry point, default preset); each module has PRESETS.
TRAINERS = {"draft-lm": ("angelspec.train.draft_lm", "train_draft_lm", "draft_lm_embedded"),
            "mtp": ("angelspec.train.mtp", "train_mtp", "mtp_embedded"),
            "eagle3": ("angelspec.train.eagle3", "train_eagle3", "eagle3_embedded"),
            "dflash": ("angelspec.train.block", "train_dflash", "dflash_embedded"),
            "dflare": ("angelspec.train.block", "train_dflare", "dflare_embedded"),
            "dfly": ("angelspec.train.block", "train_dfly", "dfly_embedded"),
            "dspark": ("angelspec.train.block", "train_dspark", "dspark_embedded")}
TRAINABLE_DRAFTERS = tuple(TRAINERS)
# Targets of at least this many parameters are real-size models (Qwen3-0.6B and up, Llama 3): the kinds listed
# here train with the report's real-size preset (GPU-sized) instead of the one sized for the embedded target.
REAL_SIZE_PARAMETERS = 500_000_000
REAL_SIZE_PRESETS = {"dfly": "qwen3_8b_dfly", "dspark": "qwen3_8b_dspark"}
BLOCK_DRAFTERS = ("dflash", "dflare", "dfly", "dspark")  # the kinds that take --head
SP_DRAFTERS = ("mtp", "eagle3", *BLOCK_DRAFTERS)  # the kinds that train with --sp (train.sequence_parallel)


def get_trainer(kind: str) -> tuple[Trainer, dict[str, Any], str]:
    """(entry point, PRESETS, default preset name) of the trainer for drafter `kind`."""
    if kind not in TRAINERS:
        raise KeyError(f"no trainer for drafter {kind!r}; trainable: {', '.join(TRAINABLE_DRAFTERS)}")
    module_name, function, preset = TRAINERS[kind]
    module = importlib.import_module(module_name)
    return getattr(module, function), module.PRESETS, preset


def preset_for_target(kind: str, num_parameters: int) -> str:
    """The preset `angelspec train --drafter KIND` uses when none is named, from the target's size: the real-size
    preset (`REAL_SIZE_PRESETS`) for a target of `REAL_SIZE_PARAMETERS` or more where the kind has one, else the
    kind's default (sized for the embedded target: a CPU run of minutes)."""
    if kind not in TRAINERS:
        raise KeyError(f"no trainer for drafter {kind!r}; trainable: {', '.join(TRAINABLE_DRAFTERS)}")
    if num_parameters >= REAL_SIZE_PARAMETERS and kind in REAL_SIZE_PRESETS:
        return REAL_SIZE_PRESETS[kind]
    return TRAINERS[kind][2]
