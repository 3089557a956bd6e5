"""Decoding: the batched draft -> verify engine and what it plugs in.

- `sampling.py`: verification maths (greedy, standard and deterministic-draft speculative sampling), pure functions.
- `engine.py`, `batching.py`, `compiled.py`, `metrics.py`: the continuous-batching engine over a static KV cache.
- `drafters/`: the drafter interface, the registry, one module per drafter family.
- `policies/`: depth policies (fixed, threshold, D-cut, Algorithm 1, the production scheduler), their cost model
  and profiler, STS calibration.
- `router.py`: the request-level workload router; `loading.py`: target / tokenizer / drafter loaders.
"""
