"""Research tools built on the AngelSpec library, kept out of it: the library (`angelspec`) never imports this
package, and no command uses it; the benchmarks and their tests do.

- `router.py`: request-level workload routing (a drafter per request, chosen by domain and measured tokens/s).
- `commit_prediction.py`: a depth policy's predicted (Eq. 21) against measured committed tokens per step.
- `oracle.py`: drafters that draft the target's own greedy continuation (every draft accepted) or never match it
  (every draft rejected), to measure the engine itself.
"""
