"""Decoding: the batched draft -> verify engine and what it plugs in.

- `sampling.py`: verification maths (greedy, standard and deterministic-draft speculative sampling), pure functions.
- `engine/`, `batching.py`, `compiled.py`, `metrics.py`: the continuous-batching engine over a static KV cache.
- `drafters/`: the drafter interface, the family records (`families.py`), one module per drafter family.
- `policies/`: depth policies (fixed, threshold, D-cut, Algorithm 1, the production scheduler), their cost model
  and profiler, STS calibration.
- `loading.py`: target / tokenizer / drafter loaders; `drafter_spec.py`: the one grammar of drafter specs.
"""
