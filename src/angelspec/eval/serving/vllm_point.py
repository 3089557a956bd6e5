"""One point of the serving sweep's vLLM column, run inside the vLLM venv (`make vllm-venv`) by `vllm.py`:

    .venv-vllm/bin/python -m angelspec.eval.serving.vllm_point JOB.json RESULT.json
    .venv-vllm/bin/python -m angelspec.eval.serving.vllm_point --check OUT.json  # {"version", "python"}

A job is one vLLM configuration (AR or n-gram speculation) at one concurrency C: one `VllmEngine` (vLLM's offline
`LLM`, fp32, its default compilation, `max_num_seqs` = C) serves one untimed warm-up `generate` of the first C
requests (`warmup_tokens` new tokens each), then the job's N requests in one timed `generate` (greedy, exactly
`max_new_tokens` tokens each, stop tokens ignored), as `sweep.run_point` times ours. One engine per process: vLLM
0.32 on CPU cannot start a second speculative engine in a process that ran one (its kernel registry refuses).

The parent sets the process up (`vllm_engine.CPU_ENV`: the engine in this process, one compute thread, a 1 GiB KV
cache) and puts its own AngelSpec first on the path, so both sides run the same code.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from angelspec.errors import EXIT_BAD_INPUT, is_user_error
from angelspec.fileio import write_json_atomic


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Serve one job (module docstring) -> {"concurrency", "requests", "output_tokens", "wall_s", "cpu_s", "engine_s",
    "drafts", "accepted_per_pos", "outputs"}: vLLM's wall and process CPU time of the timed generate, its engine
    start-up, its speculative counters over the timed run, and each request's emitted token ids."""
    from angelspec.decoding.engine import Request
    from angelspec.decoding.vllm_engine import VllmEngine

    concurrency, new = int(job["concurrency"]), int(job["max_new_tokens"])
    prompts = [list(map(int, p)) for p in job["prompts"]]
    t0 = time.perf_counter()
    engine = VllmEngine(job["target"], max_batch_size=concurrency, speculative_config=job.get("speculative_config"),
                        eager=False)
    engine_s = time.perf_counter() - t0
    try:
        if job.get("warmup_tokens", 0) > 0:
            engine.generate([Request(prompt_ids=p, max_new_tokens=int(job["warmup_tokens"]), stop_ids=())
                             for p in prompts[:concurrency]])
        requests = [Request(prompt_ids=p, max_new_tokens=new, stop_ids=(), request_id=i) for i, p in enumerate(prompts)]
        before = engine.spec_counters()
        t0, c0 = time.perf_counter(), time.process_time()
        results = engine.generate(requests)
        wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        counters = engine.spec_counters() - before
    finally:
        engine.close()
    outputs = [list(map(int, r.token_ids)) for r in results]
    return {"concurrency": concurrency, "requests": len(requests), "output_tokens": sum(map(len, outputs)),
            "wall_s": wall_s, "cpu_s": cpu_s, "engine_s": engine_s, "drafts": counters.drafts,
            "accepted_per_pos": list(counters.accepted_per_pos), "outputs": outputs}


def main(argv: list[str]) -> int:
    """`--check OUT.json` or `JOB.json RESULT.json`; bad input and a missing vLLM are one `error:` line on stderr
    and exit code 2."""
    try:
        if len(argv) == 2 and argv[0] == "--check":
            from angelspec.decoding.vllm_engine import import_vllm

            vllm = import_vllm("the vLLM column of the serving benchmark")
            write_json_atomic(Path(argv[1]), {"version": vllm.__version__, "python": sys.executable})
            return 0
        if len(argv) != 2:
            print("error: usage: python -m angelspec.eval.serving.vllm_point (--check OUT.json | JOB.json "
                  "RESULT.json)", file=sys.stderr)
            return EXIT_BAD_INPUT
        job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
        write_json_atomic(Path(argv[1]), run_job(job))
        return 0
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":  # vLLM needs the guard: a process it spawns re-imports the main module
    sys.exit(main(sys.argv[1:]))
