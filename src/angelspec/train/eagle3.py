"""`angelspec train --drafter eagle3`: the EAGLE-3 drafter, trained by the MTP trainer (`train.mtp.train_mtp_job`).

EAGLE-3 is a member of the MTP family (`models.eagle3`): the same data, packing, target features (online or
from an offline cache, `features=DIR`), TTT rollout, loss schedule, checkpoints and exact resume; only the block
and the target taps differ. This module holds the run config and the presets; `train_eagle3` is `train_mtp` with
an EAGLE-3 default preset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from angelspec.models.config import DecoderConfig
from angelspec.models.eagle3 import Eagle3Config
from angelspec.train.config import trainer
from angelspec.train.mtp import MTPFamilyTrainConfig, train_mtp_job


@dataclass(frozen=True)
class Eagle3TrainConfig(MTPFamilyTrainConfig):
    """An EAGLE-3 run: the block conditions on fc over three target taps."""

    target_layer_ids: tuple[int, int, int] | None = None  # None: (1, L//2, L-2), id i = output of layer i

    def model_config(self, target: DecoderConfig) -> Eagle3Config:
        return Eagle3Config.for_target(target, num_depths=self.num_depths, target_layer_ids=self.target_layer_ids,
                                       shape=self.layer_shape())


def eagle3_embedded() -> Eagle3TrainConfig:
    """EAGLE-3 with a 3-depth TTT unroll for the embedded target (6-layer Qwen3, hidden 256, vocab 8192: taps
    1, 3, 4). Same budget as `mtp_embedded` (the block's extra cost, fc and the 2C-wide q/k/v, is small next to
    the target forward and the LM-head passes); not yet timed against the shipped target."""
    return Eagle3TrainConfig(batch_size=2, steps=200, switch_step=60, warmup=10)


def eagle3_shipped() -> Eagle3TrainConfig:
    """The EAGLE-3 that ships with the embedded target: `eagle3_embedded`'s recipe with a 1024-token draft
    vocabulary on the 20k-prompt pool's rollouts, 5,200 steps of 4 × 512 tokens (10.6M tokens, the flagships'
    budget: its curve kept rising and it was the one shipped drafter below AR), LK^alpha cold start for the first
    300 steps, then e2e TV. (The shipped weights got their first 330 steps on a 2,300-step cosine, then were resumed
    with steps=1650, which decayed the rate to the floor by 3.4M tokens, then with steps=2850, then from step 2,850
    with steps=4150 and from step 3,200 with steps=5200: each time the rate went back up part of the way and
    annealed again.)"""
    return replace(eagle3_embedded(), batch_size=4, steps=5200, switch_step=300, warmup=50, ckpt_every=200,
                   log_every=20, draft_vocab_size=1024)


def tiny_debug() -> Eagle3TrainConfig:
    """Seconds: 3 steps on 2 short rows, switching objective after step 1 (needs a target of >= 5 layers for
    the default taps)."""
    return Eagle3TrainConfig(intermediate_size=64, seq_len=64, batch_size=2, steps=3, warmup=1, switch_step=1,
                             ckpt_every=2, log_every=1)


PRESETS = {"eagle3_embedded": eagle3_embedded, "eagle3_shipped": eagle3_shipped, "tiny_debug": tiny_debug}


train_eagle3 = trainer(train_mtp_job, eagle3_embedded, "train_eagle3",
                       "`angelspec train --drafter eagle3` (`train.config.Trainer`; default preset `eagle3_embedded`).")
