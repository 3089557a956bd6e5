"""Files that ship inside the package: the embedded default target (`assets/target/`), the draft LM
trained for it (`assets/draft_lm/`), and held-out evaluation prompts."""

from pathlib import Path

from angelspec.errors import UsageError

DEFAULT_TARGET = Path(__file__).parent / "target"
# The draft-LM baseline trained for DEFAULT_TARGET (`angelspec train --drafter draft-lm`); the demo skips
# its stage while this folder has no config.json.
DEFAULT_DRAFT_LM = Path(__file__).parent / "draft_lm"
# The drafters trained for DEFAULT_TARGET on its own rollouts (`make drafters`): one folder per drafter (dfly, mtp,
# eagle3, dspark), each with its train report and evaluation log. The demo's headline table uses them.
DEFAULT_DRAFTERS = Path(__file__).parent / "drafters"
# Held-out prompts per domain (code, math, chat) from the embedded corpus' held-out splits, for `eval`,
# benchmarks and the demo. Never used for training.
EVAL_PROMPTS = Path(__file__).parent / "prompts" / "eval.jsonl"
# Training prompts per domain (code, math, chat) from the corpus' TRAIN splits: the demo rolls them out with
# the target and trains a drafter on the responses. Disjoint from EVAL_PROMPTS by construction.
TRAIN_PROMPTS = Path(__file__).parent / "prompts" / "train.jsonl"


def resolve_target_dir(target: str | Path | None) -> Path:
    """The folder to load: `--target` if given, else the embedded target, which must be built first."""
    if target is not None:
        return Path(target)
    if not (DEFAULT_TARGET / "config.json").is_file():
        raise UsageError(
            f"the embedded target is not built yet ({DEFAULT_TARGET} has no config.json). Build it with "
            "`make data-sources && angelspec target build` (about 2 hours on 2 CPU cores; resumable with "
            "--resume), or pass --target DIR with a HF checkpoint folder"
        )
    return DEFAULT_TARGET
