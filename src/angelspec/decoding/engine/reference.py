"""A slow reference decoder the engine is tested against: one request at a time, one token per forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from angelspec.decoding.engine.types import FinishReason, Request, Result
from angelspec.decoding.sampling import BatchSampling, NoiseStream, SamplingParams, process_logits, sample
from angelspec.models.decoder import CacheInputs, Decoder


def reference_generate(target: Decoder, requests: Sequence[Request],
                       seeds: Sequence[int] | None = None) -> list[Result]:
    """Slow reference: one request at a time, one token per forward, no batching, no admission logic.

    Samples with the same counter-based noise as the engine (TARGET stream, counter = position of the
    produced token), so for greedy requests and for seeded sampled requests the engine must match it
    token for token (up to floating-point ties between batched and single-row arithmetic).
    """
    results = []
    with torch.inference_mode():
        for i, r in enumerate(requests):
            seed = r.sampling.seed if r.sampling.seed is not None else (seeds[i] if seeds is not None else 0)
            s = BatchSampling.from_params([SamplingParams(r.sampling.temperature, r.sampling.top_k,
                                                          r.sampling.top_p, seed)])
            stop = set(r.stop_ids if r.stop_ids is not None else target.config.eos_token_ids)
            prompt = list(r.prompt_ids)
            cache = target.new_cache(1, len(prompt) + r.max_new_tokens + 1)
            logits = target.forward_cached(torch.tensor([prompt]), CacheInputs(cache)).logits[:, -1]  # [1, V]
            out: list[int] = []
            finish: FinishReason = "length"
            while len(out) < r.max_new_tokens:
                pos = len(prompt) + len(out)
                if r.sampling.is_greedy:
                    tok = int(logits.argmax(dim=-1))
                else:
                    probs = process_logits(logits, s.temperature, s.top_k, s.top_p)
                    tok = int(sample(probs, s.seeds, torch.tensor([pos]), NoiseStream.TARGET))
                out.append(tok)
                if tok in stop:
                    finish = "stop"
                    break
                logits = target.forward_cached(torch.tensor([[tok]]), CacheInputs(cache)).logits[:, -1]
            results.append(Result(request_id=i if r.request_id is None else r.request_id, token_ids=out,
                                  finish_reason=finish, num_steps=len(out), prompt_len=len(prompt)))
    return results
