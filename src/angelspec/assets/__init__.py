"""Files that ship inside the package: the embedded default target (`assets/target/`)."""

from pathlib import Path

DEFAULT_TARGET = Path(__file__).parent / "target"
# Held-out prompts per domain (code, math, chat) from the embedded corpus' held-out splits, for `eval`,
# benchmarks and the demo. Never used for training.
EVAL_PROMPTS = Path(__file__).parent / "prompts" / "eval.jsonl"
