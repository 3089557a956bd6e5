"""Oracle drafters for measuring the engine itself (benchmarks/step_cost.py) and for exactness tests.

`OracleDrafter` drafts the target's own greedy continuation, read from an AR run of the same prompts: at T=0
every draft is accepted (MAL = K + 1) and proposing costs one gather on the device, so a speculative step's
time is the engine's own work plus one target forward over K + 1 tokens. `reject=True` drafts a token that
differs from the greedy one at every position, so every draft is rejected (MAL = 1): the same step cost with
nothing gained.

The drafts are a deterministic function of the row's prompt and committed length, so they are verified with
the deterministic-draft protocol and stay exact at T > 0 (where the sampled output soon leaves the greedy
continuation and the oracle's drafts become ordinary, mostly wrong, guesses).

Not registered: it needs the continuations, which no folder holds.

Shape legend: B batch rows, K draft depth, L longest prompt + continuation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from angelspec.decoding.drafters.base import Commit, Drafter, DraftState, Proposal


class OracleDrafter(Drafter):
    """continuations: prompt ids (a tuple) -> the target's greedy output for that prompt (AR, same settings)."""

    def __init__(self, continuations: Mapping[tuple[int, ...], Sequence[int]], *, reject: bool = False,
                 vocab_size: int | None = None) -> None:
        if reject and (vocab_size is None or vocab_size < 2):
            raise ValueError("OracleDrafter(reject=True) needs the vocabulary size (>= 2) to draft wrong tokens")
        self.continuations = {tuple(p): list(c) for p, c in continuations.items()}
        self.reject = reject
        self._vocab = vocab_size
        self._table = torch.zeros(0, 0, dtype=torch.int64)  # [B, L] prompt + continuation per row
        self._offsets = torch.zeros(0, dtype=torch.int64)

    def allocate(self, batch_size: int, max_len: int, *, device: torch.device, slack: int) -> None:
        longest = max((len(p) + len(c) for p, c in self.continuations.items()), default=0)
        width = max(max_len, longest) + slack + 1
        self._table = torch.zeros(batch_size, width, dtype=torch.int64, device=device)

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                target_hidden: tuple[Tensor, ...]) -> None:
        for r, prompt in zip(rows, prompts, strict=True):
            key = tuple(int(t) for t in prompt)
            if key not in self.continuations:
                raise KeyError(f"OracleDrafter: no continuation for the prompt of row {r} ({len(key)} tokens); "
                               "build it from an AR run of the same prompts")
            full = [*key, *self.continuations[key]][: self._table.shape[1]]
            self._table[r].zero_()
            self._table[r, : len(full)] = torch.tensor(full, dtype=torch.int64)

    def propose(self, state: DraftState) -> Proposal:
        k = state.num_draft_tokens
        width = self._table.shape[1]
        # seq_lens counts the committed tokens including last_tokens, so the next token sits at index seq_lens.
        idx = (state.seq_lens[:, None] + torch.arange(k, device=self._table.device)).clamp(max=width - 1)  # [B, K]
        tokens = self._table.gather(1, idx)  # [B, K]
        if self.reject:
            tokens = (tokens + 1) % self._vocab  # never the greedy token
        return Proposal(tokens=tokens, confidences=torch.ones(tokens.shape, device=tokens.device), deterministic=True)

    def on_commit(self, commit: Commit) -> None:
        pass  # the committed length arrives with the next DraftState


def greedy_continuations(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]
                         ) -> dict[tuple[int, ...], list[int]]:
    """The oracle's table from an AR run: prompt ids -> output ids, in the same order."""
    return {tuple(int(t) for t in p): [int(t) for t in o] for p, o in zip(prompts, outputs, strict=True)}
