"""What every training run shares: the base of the run configs and the one entry-point signature of a trainer.

`RunConfig` holds the optimiser and run-length fields every config has (warm-up + cosine schedule, AdamW,
clipping, seed, checkpoint and log intervals); `LMRunConfig` adds what the causal-LM trainers (the embedded
target, the draft-LM baseline) share, `DrafterRunConfig` what the drafters trained on the frozen target's
features share (MTP, EAGLE-3, the block drafters). A trainer's config extends one of them and re-declares only
the defaults it changes (a re-declared field keeps its name and type). `train.overrides` sets any of these
fields with `key=value`.

`Trainer` is the entry point `angelspec train --drafter KIND` calls (`train.registry`); `trainer(body, default)`
makes one from a `body(job, config)` so that the signature and its parameter handling exist only here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from angelspec.models.config import DraftShape
    from angelspec.models.device import Placement

C = TypeVar("C")

# What a drafter with a draft vocabulary is trained to score (`DrafterRunConfig.train_vocab`).
TRAIN_VOCABS = ("full", "draft")


@dataclass(frozen=True)
class RunConfig:
    """Optimisation and run length, read by the training loops (`train.lm`, `train.loop`)."""

    seq_len: int = 512  # tokens per packed row
    batch_size: int = 8  # global rows per step (divided over the processes under data parallelism)
    steps: int = 300
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.05  # the cosine ends at min_lr_ratio · lr
    warmup: int = 20  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW, matrices only (`train.optim.build_adamw`)
    grad_clip: float = 1.0  # max gradient norm (0: no clipping)
    seed: int = 0  # model init and data order
    ckpt_every: int = 50
    log_every: int = 10

    def require_positive(self, names: tuple[str, ...], error: type[Exception] = ValueError) -> None:
        """Raise `error` naming the first of the fields `names` that is below 1."""
        for name in names:
            if getattr(self, name) < 1:
                raise error(f"{type(self).__name__}.{name} must be >= 1, got {getattr(self, name)}")


DOMAIN_WEIGHTS = (("code", 2.0), ("math", 1.5), ("chat", 1.0), ("docs", 0.5))


@dataclass(frozen=True)
class LMRunConfig(RunConfig):
    """A causal-LM run on packed plain-text documents (`train.lm.train_causal_lm`)."""

    bf16: bool = False  # autocast the forward to bfloat16
    # Repeat factor per domain per epoch: code and maths are what a small model learns fastest and where
    # drafters shine, so they are weighted up.
    domain_weights: tuple[tuple[str, float], ...] = DOMAIN_WEIGHTS
    heldout_docs_per_domain: int = 50  # documents per domain for the held-out loss of the report


@dataclass(frozen=True)
class DrafterRunConfig(RunConfig):
    """A drafter run on the frozen target's features (`train.loop.train_drafter_steps`): the draft layers'
    attention and MLP shapes (None = the target's), the teacher support, the objective switch, the data
    rendering and where the features come from."""

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    switch_step: int = 100  # the cold-start objective before this step, the final one from it
    top_k: int | None = None  # teacher support for KL / TV / α (None = full vocabulary)
    enable_thinking: bool = False  # render conversations with the chat template's thinking blocks
    init_std: float = 0.02
    features: str | None = None  # an offline feature cache (`angelspec features`) instead of the target forward
    draft_vocab_size: int = 0  # >0: inference drafts from the N most frequent trained-on tokens (data.vocab)
    # "full": training scores the whole vocabulary (the draft vocabulary is applied at inference only); "draft" (needs
    # draft_vocab_size): the drafter's head scores only the draft vocabulary, and the losses see the teacher on it
    # plus one bucket for the mass outside it (train.losses "Draft vocabulary"): the acceptance of the drafter
    # inference runs, and an LM head draft_vocab_size / vocab_size as large in every training step.
    train_vocab: str = "full"

    def layer_shape(self) -> DraftShape:
        """The draft layers' shape overrides, as the models' `for_target` take them."""
        from angelspec.models.config import DraftShape

        return DraftShape(num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                          head_dim=self.head_dim, intermediate_size=self.intermediate_size)

    def check_train_vocab(self, error: type[Exception] = ValueError, *, draft_vocab_size: int | None = None,
                          name_only: bool = False) -> None:
        """Raise `error` for an unknown `train_vocab`, or "draft" without a draft vocabulary (`draft_vocab_size`:
        the drafter's, when it does not come from this config; `name_only`: not known yet, check the name only)."""
        if self.train_vocab not in TRAIN_VOCABS:
            raise error(f"unknown train_vocab {self.train_vocab!r}; choose one of {', '.join(TRAIN_VOCABS)}")
        size = self.draft_vocab_size if draft_vocab_size is None else draft_vocab_size
        if self.train_vocab == "draft" and not size and not name_only:
            raise error("train_vocab=draft trains the drafter on its draft vocabulary, and this drafter has none: set "
                        "draft_vocab_size=N (e.g. 1024) or train_vocab=full")

    def checkpoint_defaults(self) -> dict[str, Any]:
        """Settings a checkpoint written before they existed lacks, with the value its run had (as far as this
        run is concerned): `resume` fills them into the checkpoint's train_config before comparing it with this
        run's, so an older run resumes under its old settings and is refused, naming them, under new ones."""
        return {}


# ----- the trainer entry point -----


@dataclass(frozen=True)
class Parallelism:
    """How a training run spreads over the processes of a torchrun launch: `distributed` None or "auto" (DDP under a
    multi-process torchrun, else one process), "none", "ddp" or "fsdp2" (`train.distributed`); `sp` the
    sequence-parallel group size (1 = none; `train.sequence_parallel`)."""

    distributed: str | None = None
    sp: int = 1


class Trainer(Protocol):
    """`train_X(target_dir, data, out_dir, *, config, ...)`: train drafter X for the target at `target_dir` on
    `data` (a JSONL file of conversations or a corpus folder of <domain>/train.jsonl), write it to `out_dir` and
    return the report (also written as `out_dir/train_report.json`).

    `config` None takes the trainer's default preset; `resume` continues from the newest checkpoint, `force`
    overwrites an existing model; `max_minutes` stops at a checkpoint when the time runs out; `log` receives
    the progress lines (rank 0 only); `parallel`: data and sequence parallelism (`Parallelism`; sequence parallelism
    in the drafter trainers of the MTP family and the block drafters); `placement`: the
    target's device and dtype (None: `angelspec.models.device.resolve_placement()`); the drafter trains in fp32
    master weights on that device, under autocast when the dtype is 16-bit."""

    def __call__(self, target_dir: str | Path, data: str | Path, out_dir: str | Path, *, config: Any = None,
                 resume: bool = False, force: bool = False, progress: bool = True, max_minutes: float | None = None,
                 log: Callable[[str], None] = print, parallel: Parallelism = Parallelism(),
                 placement: Placement | None = None) -> dict[str, Any]: ...


@dataclass(frozen=True)
class TrainJob:
    """The arguments of one `Trainer` call other than the config."""

    target_dir: Path
    data: Path
    out_dir: Path
    resume: bool = False
    force: bool = False
    progress: bool = True
    max_minutes: float | None = None
    log: Callable[[str], None] = print
    parallel: Parallelism = Parallelism()  # data and sequence parallelism
    placement: Placement | None = None  # the target's device and dtype (None: the default of resolve_placement)


def trainer(body: Callable[[TrainJob, C], dict[str, Any]], default: Callable[[], C], name: str,
            doc: str) -> Trainer:
    """The `Trainer` called `name` (docstring `doc`) that runs `body(job, config or default())`, holding the output
    folder's lock and turning file-system faults into one line (`train.safety.run_guard`)."""
    from angelspec.train.safety import check_bounds, is_main_process, run_guard

    def train(target_dir, data, out_dir, *, config=None, resume=False, force=False, progress=True,
              max_minutes=None, log=print, parallel=Parallelism(), placement=None) -> dict[str, Any]:
        job = TrainJob(Path(target_dir), Path(data), Path(out_dir), resume, force, progress, max_minutes, log,
                       parallel, placement)
        config = default() if config is None else config
        check_bounds(config)
        with run_guard(job.out_dir, main=is_main_process()):
            return body(job, config)

    train.__name__ = train.__qualname__ = name
    train.__doc__ = doc
    return train
