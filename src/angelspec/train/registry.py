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
BLOCK_DRAFTERS = ("dflash", "dflare", "dfly", "dspark")  # the kinds that take --head
SP_DRAFTERS = ("mtp", "eagle3", *BLOCK_DRAFTERS)  # the kinds that train with --sp (train.sequence_parallel)


def get_trainer(kind: str) -> tuple[Trainer, dict[str, Any], str]:
    """(entry point, PRESETS, default preset name) of the trainer for drafter `kind`."""
    if kind not in TRAINERS:
        raise KeyError(f"no trainer for drafter {kind!r}; trainable: {', '.join(TRAINABLE_DRAFTERS)}")
    module_name, function, preset = TRAINERS[kind]
    module = importlib.import_module(module_name)
    return getattr(module, function), module.PRESETS, preset
