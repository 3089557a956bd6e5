"""The drafter families `angelspec train` can train: one `TrainableFamily` record each, the training half of the
family's record (`angelspec.decoding.drafters.families.DrafterFamily` holds the decoding half, `family()` finds it).

Every trainer module has `PRESETS` (name -> config) and an entry point with one signature, `train.config.Trainer`:
`train_X(target_dir, data, out_dir, *, config, resume, force, ...)`. A record names its trainer through a small
loader function that imports it on first use (a trainer pulls in torch and the data pipeline, which
`angelspec --help` does not need); the imports are plain import statements, so the layer check sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from angelspec.decoding.drafters.families import DrafterFamily
    from angelspec.train.config import Trainer

# Targets of at least this many parameters are real-size models (Qwen3-0.6B and up, Llama 3): a family with a
# `real_size_preset` trains with it there (GPU-sized) instead of the preset sized for the embedded target.
REAL_SIZE_PARAMETERS = 500_000_000

Presets = Mapping[str, Callable[[], Any]]


@dataclass(frozen=True)
class TrainableFamily:
    """How one drafter family trains.

    name: the family's name (`DrafterFamily.name`, the `--drafter` of `angelspec train`).
    load: imports the trainer module and returns (its `Trainer` entry point, its PRESETS).
    default_preset: the preset used when none is named (sized for the embedded target: a CPU run of minutes).
    real_size_preset: the preset for a target of `REAL_SIZE_PARAMETERS` or more (None: `default_preset`).
    sequence_parallel: trains with `--sp` (`train.sequence_parallel`).
    block: a block drafter (takes `--head` and the block-drafter flags).
    """

    name: str
    load: Callable[[], tuple[Trainer, Presets]]
    default_preset: str
    real_size_preset: str | None = None
    sequence_parallel: bool = True
    block: bool = False

    @property
    def trainer(self) -> Trainer:
        return self.load()[0]

    @property
    def presets(self) -> Presets:
        return self.load()[1]

    def preset_for(self, num_parameters: int) -> str:
        """The preset `angelspec train` uses when none is named, from the target's size (`REAL_SIZE_PARAMETERS`)."""
        if num_parameters >= REAL_SIZE_PARAMETERS and self.real_size_preset is not None:
            return self.real_size_preset
        return self.default_preset

    def family(self) -> DrafterFamily:
        """The decoding half of the record: the engine adapter and model class of the drafters this trains."""
        from angelspec.decoding.drafters.families import get_family

        return get_family(self.name)


def _draft_lm() -> tuple[Trainer, Presets]:
    from angelspec.train.draft_lm import PRESETS, train_draft_lm

    return train_draft_lm, PRESETS


def _mtp() -> tuple[Trainer, Presets]:
    from angelspec.train.mtp import PRESETS, train_mtp

    return train_mtp, PRESETS


def _eagle3() -> tuple[Trainer, Presets]:
    from angelspec.train.eagle3 import PRESETS, train_eagle3

    return train_eagle3, PRESETS


def _block(kind: str) -> Callable[[], tuple[Trainer, Presets]]:
    def load() -> tuple[Trainer, Presets]:
        from angelspec.train.block import KIND_TRAINERS, PRESETS

        return KIND_TRAINERS[kind], PRESETS

    return load


TRAINABLE: dict[str, TrainableFamily] = {f.name: f for f in (
    TrainableFamily("draft-lm", _draft_lm, "draft_lm_embedded", sequence_parallel=False),
    TrainableFamily("mtp", _mtp, "mtp_embedded"),
    TrainableFamily("eagle3", _eagle3, "eagle3_embedded"),
    TrainableFamily("dflash", _block("dflash"), "dflash_embedded", block=True),
    TrainableFamily("dflare", _block("dflare"), "dflare_embedded", block=True),
    TrainableFamily("dfly", _block("dfly"), "dfly_embedded", real_size_preset="qwen3_8b_dfly", block=True),
    TrainableFamily("dspark", _block("dspark"), "dspark_embedded", real_size_preset="qwen3_8b_dspark", block=True),
)}
TRAINABLE_DRAFTERS = tuple(TRAINABLE)
BLOCK_DRAFTERS = tuple(f.name for f in TRAINABLE.values() if f.block)  # the kinds that take --head
SP_DRAFTERS = tuple(f.name for f in TRAINABLE.values() if f.sequence_parallel)  # the kinds that train with --sp


def trainable(kind: str) -> TrainableFamily:
    """The training record of drafter family `kind`."""
    if kind not in TRAINABLE:
        raise KeyError(f"no trainer for drafter {kind!r}; trainable: {', '.join(TRAINABLE_DRAFTERS)}")
    return TRAINABLE[kind]


def get_trainer(kind: str) -> tuple[Trainer, Presets, str]:
    """(entry point, PRESETS, default preset name) of the trainer for drafter `kind`."""
    record = trainable(kind)
    train_fn, presets = record.load()
    return train_fn, presets, record.default_preset


def preset_for_target(kind: str, num_parameters: int) -> str:
    """The preset `angelspec train --drafter KIND` uses when none is named, from the target's size: the kind's real-size
    preset for a target of `REAL_SIZE_PARAMETERS` or more where it has one, else its default (sized for the embedded
    target: a CPU run of minutes)."""
    return trainable(kind).preset_for(num_parameters)
