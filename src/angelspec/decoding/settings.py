"""How a decoding command decodes, as one typed value the command line builds and the library takes
(`generate.generate_completions`, `eval.runs.evaluate_drafters`).

The drafter is not part of it (one run of `eval` compares several): it travels beside it as a parsed
`drafter_spec.DrafterSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from angelspec.decoding.limits import check_counts


@dataclass(frozen=True)
class DecodeSettings:
    """num_draft_tokens: K (None: the depth each drafter was trained for, `loading.draft_depth`); max_new_tokens: per
    request; batch_size: requests decoded at once; temperature / top_p / top_k: sampling (temperature 0: greedy);
    seed S: request i uses S + i (None: random); think: render prompts with the chat template's thinking on;
    policy: a `--policy` spec (`policies.factory`); cost_table: the step-cost table a budget policy reads (None: the
    cached one for this setup); spec_gate: skip drafting where plain steps are faster (`EngineConfig.spec_gate`);
    compile: torch.compile the target's forwards and the drafter's hot calls (`EngineConfig.compile`)."""

    num_draft_tokens: int | None = None
    max_new_tokens: int = 128
    batch_size: int = 8
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = 0
    think: bool = False
    policy: str = "full"
    cost_table: str | Path | None = None
    spec_gate: bool = False
    compile: bool = False

    def check_counts(self, limit: int | None = None) -> None:
        """The fixed bounds of the counts (`limits.check_counts`), before any weights are read."""
        check_counts(max_new_tokens=self.max_new_tokens, batch_size=self.batch_size,
                     num_draft_tokens=self.num_draft_tokens, limit=limit)
