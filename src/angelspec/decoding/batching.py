"""Row-level helpers shared by the engine and the drafters that own a model: ragged prompt batches and prefill
of a subset of KV-cache rows.

Shape legend: B cache rows, n joining rows, P prompt length, S cache slots, V vocab, D model dim, L layers,
Hkv key/value heads, Dh head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from angelspec.models.decoder import CacheInputs, Decoder, DecoderOutput
from angelspec.models.kv_cache import StaticKVCache


def pad_prompts(prompts: Sequence[Sequence[int]], device: torch.device, pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Right-pad ragged prompts: -> ids [n, P_max] int64, lengths [n] int64 (one host->device copy each)."""
    p_max = max(len(p) for p in prompts)
    ids = torch.tensor([list(p) + [pad_id] * (p_max - len(p)) for p in prompts], dtype=torch.int64, device=device)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)
    return ids, lengths


def prefill_rows(
    model: Decoder,
    cache: StaticKVCache,
    rows: Sequence[int],
    prompts: Sequence[Sequence[int]],
    *,
    hidden_layers: Sequence[int] = (),
    compute_logits: bool = True,
) -> DecoderOutput:
    """Prefill `prompts` into cache `rows` (replacing whatever they held); logits only at each prompt's last
    position: -> DecoderOutput(logits [n, 1, V], hidden one [n, P_max, D] per tap id; zeros past a prompt's end
    when the prompts are ragged).

    Ragged prompts run packed (`CacheInputs.keep`): projections and MLPs see only the real tokens, not
    the padding up to the longest prompt (a batch of one long and many short prompts would otherwise cost
    n x P_max tokens). When all B rows join at once (the first admission) the forward runs on the cache itself.
    Otherwise it runs on a temporary n-row cache and the keys/values are copied into the rows: the model only
    runs on full caches, and computing all B rows to fill n of them would cost B/n times more.
    """
    ids, lengths = pad_prompts(prompts, cache.device)  # [n, P_max], [n]
    n, p_max = ids.shape
    num_keep = sum(len(p) for p in prompts)
    if num_keep < n * p_max:  # ragged: no padding through the projections and MLPs
        keep = torch.arange(p_max, device=cache.device)[None, :] < lengths[:, None]  # [n, P_max]
        how = dict(keep=keep, num_keep=num_keep, compute_logits=False)
    else:
        how = dict(logits_index=(lengths - 1)[:, None], compute_logits=compute_logits)  # [n, 1]
    if list(rows) == list(range(cache.batch_size)):
        cache.reset()
        out = model.forward_cached(ids, CacheInputs(cache, num_new=lengths, kv_len=p_max, hidden_layers=hidden_layers,
                                                    **how))
    else:
        tmp = model.new_cache(n, p_max, slack=0, dtype=cache.dtype)
        out = model.forward_cached(ids, CacheInputs(tmp, num_new=lengths, kv_len=p_max, hidden_layers=hidden_layers,
                                                    **how))
        idx = torch.as_tensor(list(rows), dtype=torch.int64, device=cache.device)
        for layer in range(model.config.num_hidden_layers):
            cache.k[layer][idx, :, :p_max] = tmp.k[layer]  # [n, Hkv, P_max, Dh]
            cache.v[layer][idx, :, :p_max] = tmp.v[layer]
        cache.lengths[idx] = lengths
    if compute_logits and out.logits is None:  # packed: the head only at each prompt's last token
        h = out.last_hidden  # [n, P_max, D]
        out.logits = model.head_logits(h.gather(1, (lengths - 1)[:, None, None].expand(-1, 1, h.shape[-1])))
    return out
