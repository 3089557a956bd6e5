"""Data-parallel training under torchrun: DDP or FSDP2, CPU (gloo) or CUDA (nccl; ANGELSPEC_DIST_BACKEND=gloo forces
gloo, e.g. for CPU-only runs on a GPU machine). Each rank trains on its own GPU (`rank_device`), and the collectives
hand the process group tensors on the device its backend needs (`group_device`).

The torchtitan habit: a trainer builds its model first and applies parallelism afterwards with
`wrap_model`; model code never sees a process group. What a trainer does to be data-parallel:

1. `info = init_distributed()` — reads torchrun's `RANK` / `LOCAL_RANK` / `WORLD_SIZE` / `MASTER_*`; a plain
   `python` launch (no `WORLD_SIZE`) is a no-op single process, so single-process runs do not change.
2. `resolve_strategy(requested, info)` — "auto" (or None) picks DDP under torchrun, "none" otherwise.
3. `wrap_model(module, strategy, info)` — DDP, FSDP2 `fully_shard`, or the module itself. Only the trainable
   drafter is wrapped: a frozen target has no gradients to synchronise, so every rank keeps its own copy.
   DDP and FSDP2 act through the wrapper's `forward`; code that calls a block's methods directly (the TTT
   rollout) goes through a `FunctionModule` so that the hooks run.
4. `shard_rows(global_rows, info)` — each rank takes a contiguous slice of the global batch, so the global
   batch and the data order are exactly the single-process run's.
5. Losses are normalised over the global batch (`train.losses.global_denominators(global_sum)`): each rank's
   loss is its share of the single-process loss, and the trainer backpropagates `world_size · loss` because
   DDP and FSDP2 average gradients over ranks. The summed gradient then equals the single-process one up to
   floating-point reduction order.
6. Only rank 0 writes checkpoints, logs and progress bars (`info.is_main`); logged scalars are all-reduced
   (`all_reduce_scalars`); model weights for writing come from `full_state_dict` (a collective: every rank
   calls it, rank 0 writes).
7. Resuming: every rank reads the checkpoint's whole weights and keeps its part (`load_full_state_dict`); the
   optimizer state is saved whole, keyed by parameter name, and re-sharded the same way
   (`train.checkpoint.optimizer_state` / `load_optimizer_state` with `model=`), so an FSDP2 run resumes exactly.

Sequence parallelism (`train.sequence_parallel`) sits on top: groups of N ranks share rows and split their tokens;
DDP / FSDP2 still span all ranks and the row slices go to the groups (`SequenceParallel.dp`).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

Strategy = Literal["none", "ddp", "fsdp2"]
STRATEGIES: tuple[str, ...] = ("auto", "none", "ddp", "fsdp2")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the data-parallel group (world_size 1 = a plain single process)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    launched: bool = False  # started by torchrun (WORLD_SIZE in the environment)
    owns_group: bool = False  # init_distributed created the process group (and shutdown destroys it)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


BACKEND_ENV = "ANGELSPEC_DIST_BACKEND"  # "gloo" or "nccl": the process group's backend, whatever the machine has


def dist_backend(backend: str | None = None) -> str:
    """The backend a process group is created with: `backend`, else $ANGELSPEC_DIST_BACKEND, else nccl when CUDA is
    available and gloo otherwise (gloo forced on a GPU machine keeps CPU-only runs, e.g. the test suite, off NCCL)."""
    name = backend or os.environ.get(BACKEND_ENV) or ("nccl" if torch.cuda.is_available() else "gloo")
    if name not in ("gloo", "nccl"):
        raise ValueError(f"{BACKEND_ENV}={name!r}: the process-group backend is gloo or nccl")
    return name


def init_distributed(backend: str | None = None) -> DistInfo:
    """Join the process group torchrun describes in the environment; no-op for a single process.

    backend: as `dist_backend` (None: $ANGELSPEC_DIST_BACKEND, else nccl when CUDA is available, else gloo).
    Idempotent: an existing group is reused."""
    if "WORLD_SIZE" not in os.environ:
        return DistInfo()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = dist_backend(backend)
    use_cuda = backend == "nccl"
    device = f"cuda:{local_rank}" if use_cuda else "cpu"
    if world == 1:
        return DistInfo(rank, local_rank, 1, device, launched=True)
    owns = False
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
        owns = True
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device, launched=True, owns_group=owns)


def shutdown(info: DistInfo) -> None:
    """Destroy the process group if `init_distributed` created it.

    Drop DDP / FSDP2 wrappers first: a DDP reducer that outlives its group is destroyed at interpreter exit
    with its communication thread still running, and the process aborts ("terminate called without an active
    exception", seen about once in 20 launches). The wrappers hold reference cycles, hence the collect."""
    if info.owns_group and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def resolve_strategy(requested: str | None, info: DistInfo) -> Strategy:
    """"auto"/None: DDP under a multi-process torchrun, else "none". DDP/FSDP2 outside torchrun is an error;
    a one-process torchrun runs as "none" (there is nothing to synchronise)."""
    name = requested or "auto"
    if name not in STRATEGIES:
        raise ValueError(f"unknown distributed strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    if name == "auto":
        return "ddp" if info.enabled else "none"
    if name != "none" and not info.launched:
        raise ValueError(f"--distributed {name} needs a torchrun launch, e.g. `torchrun --nproc_per_node 2 -m "
                         f"angelspec.cli train ...` (WORLD_SIZE is not set)")
    if name != "none" and not info.enabled:
        return "none"
    return name  # type: ignore[return-value]


class FunctionModule(nn.Module):
    """`forward(*args) = fn(module, *args)`: lets DDP / FSDP2 hooks run around code that calls a module's
    methods or submodules directly. `fn` should return tensors or tuples of tensors (FSDP2 and DDP find the
    outputs to hook by flattening them as pytrees; a dataclass would hide them)."""

    def __init__(self, module: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.module, *args, **kwargs)


def wrap_model(model: nn.Module, strategy: Strategy, info: DistInfo) -> nn.Module:
    """Apply data parallelism to an already-built trainable model.

    "none": the model itself. "ddp": `DistributedDataParallel`, frozen parameters excluded from the
    broadcast and the gradient buckets. "fsdp2": `fully_shard` over a 1-D mesh of all ranks, frozen
    parameters ignored (left whole on every rank); the model's parameters become DTensor shards, so build
    the optimizer after this call and gather weights with `full_state_dict`."""
    if strategy == "none":
        return model
    if not info.enabled:
        raise ValueError(f"strategy {strategy!r} needs an initialised process group (init_distributed under "
                         "torchrun)")
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if frozen:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(frozen))
        device = _module_device(model)
        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(_module_device(model).type, (info.world_size,))
        ignored = {p for p in model.parameters() if not p.requires_grad}
        return fully_shard(model, mesh=mesh, ignored_params=ignored or None)
    raise ValueError(f"unknown strategy {strategy!r}")


def _module_device(model: nn.Module) -> torch.device:
    """Where a trainable model's parameters live (the rank's device)."""
    return next((p.device for p in model.parameters() if p.requires_grad), torch.device("cpu"))


def rank_device(device: torch.device, info: DistInfo) -> torch.device:
    """The device this rank trains on: under a torchrun launch on CUDA, GPU `LOCAL_RANK` (one GPU per process);
    otherwise `device` itself."""
    if info.launched and device.type == "cuda":
        return torch.device("cuda", info.local_rank)
    return device


def group_device() -> torch.device:
    """Where tensors handed to the process group's collectives must live: the current GPU under NCCL, else the
    host (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_rows(rows: Sequence[int], info: DistInfo) -> list[int]:
    """This rank's contiguous slice of the global batch `rows` (rank r takes rows r·b .. r·b+b-1, b = B/W).

    The global batch must divide evenly, so every rank does the same work and the union is the batch."""
    rows = list(rows)
    if len(rows) % info.world_size:
        raise ValueError(f"the global batch of {len(rows)} rows does not divide over {info.world_size} ranks; "
                         "choose batch_size as a multiple of the number of processes")
    b = len(rows) // info.world_size
    return rows[info.rank * b:(info.rank + 1) * b]


def global_sum(t: Tensor) -> Tensor:
    """Sum of `t` over all ranks (a new tensor; `t` is not modified); `t` itself for a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    out = t.detach().to(group_device(), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(t.device)


def all_reduce_scalars(values: dict[str, float], op: Literal["sum", "mean"] = "mean") -> dict[str, float]:
    """Sum or mean of logged scalars over ranks, in one float64 all-reduce (one sync per log interval)."""
    if not values or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=group_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    if op == "mean":
        t /= dist.get_world_size()
    return dict(zip(keys, t.tolist(), strict=True))


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is True on any (e.g. a time budget seen by one rank first)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device=group_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _full(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """`clip_grad_norm_` that also works on FSDP2's DTensor gradients (the norm is gathered to a full
    scalar first, as torchtitan does); returns the total norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    total = _full(torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """The module's state dict with FSDP2 shards gathered into whole tensors. A collective under FSDP2:
    every rank must call it (rank 0 then writes)."""
    return {k: _full(v).detach().clone() for k, v in module.state_dict().items()}


def has_dtensors(module: nn.Module) -> bool:
    """True when FSDP2 has turned (some of) `module`'s parameters into DTensor shards."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def load_full_state_dict(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Load whole tensors (e.g. a checkpoint's safetensors) into `module`, strictly. Under FSDP2 every rank
    calls it with the same `state` and keeps its own shard of each parameter (a plain `load_state_dict` would
    try to copy whole tensors into DTensor shards)."""
    if not has_dtensors(module):
        module.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=True))


def whole_copy(module: nn.Module, factory: Callable[[], nn.Module]) -> nn.Module:
    """`module` itself when it holds no FSDP2 shards, else `factory()` (an unwrapped twin) loaded with the
    gathered weights, e.g. for writing. A collective under FSDP2: every rank calls it."""
    if not has_dtensors(module):
        return module
    twin = factory()
    twin.load_state_dict(full_state_dict(module))
    return twin
