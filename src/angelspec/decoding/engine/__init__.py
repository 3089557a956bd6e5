"""The batched decoding engine: plain autoregressive generation (no drafter) and lossless speculative
decoding (draft -> choose depth -> one target forward -> verify -> commit), both with continuous batching.

Rows and requests
-----------------
`generate(requests)` runs a queue of requests over at most `max_batch_size` rows, each row a slot of one
static KV cache. Between steps, finished requests leave their rows and queued ones join them (a prefill
of just the joining rows, ragged prompts padded and masked). A row's committed sequence is
prompt + emitted tokens; the target cache holds every committed token but the newest ("last"), which is
the input of the next step:

    AR step           input [B, 1] = last            -> one logits row -> one token per row
    speculative step  input [B, n+1] = last, d_1..d_n -> verify -> num_accepted + 1 tokens per row,
                      then cache.truncate(old_len + num_accepted + 1) (rows keep exactly what they committed)

Stop tokens are INCLUDED in `Result.token_ids` (finish_reason "stop"); max_new_tokens truncates
(finish_reason "length"). A stop token or the length limit inside an accepted block truncates the block.

Randomness and batch independence
---------------------------------
Every random number comes from one counter-based hash (`sampling.uniform_noise` for accept coins,
`sampling.exponential_noise`, float32, for token draws), keyed by (request seed, absolute position of the
produced token, stream): a request draws the same tokens alone or in any batch at any row. An AR step and
a depth-0 speculative step draw the same token for the same request (see `sampling`'s docstring).

Layout
------
* `types`: `Request`, `Result`, `EngineConfig`, `VerifyEvent`;
* `scheduler`: admission, slots, release, request checks, seeds (`Scheduler`, the rows' state);
* `forwards`: the target's forward variants, one table, eager or compiled, and their warm-up (`TargetForwards`);
* `step`: the AR step and the speculative step, draft -> select -> verify -> commit (`Step`);
* `core`: `SpecEngine`, the three composed, and the generate loop; `reference`: `reference_generate`.

Shapes are static within a step. Host-side upper bounds of row lengths give the target its `kv_len`, so attention
only reads the slots in use. Idle rows (queue drained, others still running) are still computed: they are masked,
not removed.

Shape legend: B rows, T tokens per forward, K draft depth, n verify width (<= K), V vocab, D model dim.
"""

from angelspec.decoding.engine.core import SpecEngine
from angelspec.decoding.engine.reference import reference_generate
from angelspec.decoding.engine.types import (
    DepthPolicyFn,
    EngineConfig,
    FinishReason,
    Request,
    Result,
    VerifyEvent,
    VerifyProtocol,
)

__all__ = ["DepthPolicyFn", "EngineConfig", "FinishReason", "Request", "Result", "SpecEngine", "VerifyEvent",
           "VerifyProtocol", "reference_generate"]
