"""Our decoder must reproduce HF transformers' logits on the same checkpoint (fp32, 1e-4), for
prefill and for cached decode after appends and rollbacks, across the supported families."""

from __future__ import annotations

import json

import pytest
import torch

from angelspec.models import CheckpointError, ConfigError, Decoder, DecoderConfig, load_target, save_target
from angelspec.models.decoder import CacheInputs, TrainInputs

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def _cfg(family: str, **kw) -> DecoderConfig:
    base = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10000.0)
    flags = {
        "qwen3": dict(model_type="qwen3", qk_norm=True, tie_word_embeddings=True),
        "llama": dict(model_type="llama", qk_norm=False, tie_word_embeddings=False),
        "qwen2": dict(model_type="qwen2", qk_norm=False, qkv_bias=True, tie_word_embeddings=False),
    }[family]
    return DecoderConfig(**{**base, **flags, **kw})


def _random_model(cfg: DecoderConfig, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    m = Decoder(cfg)
    m.init_weights(std=0.1)
    with torch.no_grad():  # non-trivial norms and biases so a missing one is caught
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return m.eval()


def _hf_pair(tmp_path, cfg: DecoderConfig):
    save_target(_random_model(cfg), tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    return load_target(tmp_path), hf


FAMILIES = ["qwen3", "llama", "qwen2"]
ROPES = [None, {"rope_type": "linear", "factor": 2.0},
         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64},
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rope", ROPES, ids=["default", "linear", "llama3", "yarn"])
@torch.no_grad()
def test_prefill_matches_hf(tmp_path, family, rope):
    ours, hf = _hf_pair(tmp_path, _cfg(family, rope_scaling=rope))
    ids = torch.randint(0, 97, (2, 150), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits
    out = ours(ids).logits
    assert (out - ref).abs().max() < TOL


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_cached_decode_with_appends_and_rollbacks_matches_hf(tmp_path, family):
    ours, hf = _hf_pair(tmp_path, _cfg(family))
    g = torch.Generator().manual_seed(2)
    B, total = 3, 60
    seqs = torch.randint(0, 97, (B, total), generator=g)
    full = hf(seqs).logits  # [B, total, V] reference for every prefix
    cache = ours.new_cache(B, 80, slack=8)
    prompt = torch.tensor([5, 9, 13])
    # Ragged prefill: rows have different prompt lengths; padded tail positions are ignored.
    out = ours.forward_cached(seqs[:, :13], CacheInputs(cache, num_new=prompt))
    for b in range(B):
        assert (out.logits[b, : prompt[b]] - full[b, : prompt[b]]).abs().max() < TOL
    assert cache.lengths.tolist() == prompt.tolist()
    # Several rounds of "append k speculative tokens, keep only some" per row.
    for k, keep in [(4, [1, 4, 2]), (6, [6, 0, 3]), (1, [1, 1, 1]), (8, [2, 5, 8])]:
        start = cache.lengths.clone()
        idx = start[:, None] + torch.arange(k)
        out = ours.forward_cached(seqs.gather(1, idx), CacheInputs(cache))
        for b in range(B):
            assert (out.logits[b] - full[b, start[b]: start[b] + k]).abs().max() < TOL
        cache.truncate(start + torch.tensor(keep))  # rollback: stale slots beyond must be invisible


@torch.no_grad()
def test_hidden_taps_match_hf_hidden_states(tmp_path):
    ours, hf = _hf_pair(tmp_path, _cfg("qwen3"))
    ids = torch.randint(0, 97, (1, 20))
    ref = hf(ids, output_hidden_states=True).hidden_states
    out = ours(ids, TrainInputs(hidden_layers=[0, 2, 1]))
    # id i is the output of decoder layer i == HF hidden_states[i + 1] (the last one is pre-norm)
    for tap, i in zip(out.hidden, [0, 2, 1], strict=True):
        if i == 2:  # HF's last entry has the final norm applied; ours is the raw layer output
            assert (ours.norm(tap) - ref[-1]).abs().max() < TOL
        else:
            assert (tap - ref[i + 1]).abs().max() < TOL
    with pytest.raises(ValueError, match="hidden layer id 3 out of range"):
        ours(ids, TrainInputs(hidden_layers=[3]))


@torch.no_grad()
def test_logits_index_and_document_mask():
    m = _random_model(_cfg("qwen3"))
    ids = torch.randint(0, 97, (2, 12))
    full = m(ids).logits
    idx = torch.tensor([[3, 11], [0, 5]])
    part = m(ids, TrainInputs(logits_index=idx)).logits
    assert torch.allclose(part, full.gather(1, idx[..., None].expand(-1, -1, 97)), atol=1e-6)
    # Two packed documents with document-local positions behave like two separate sequences.
    doc = torch.tensor([[0] * 5 + [1] * 7])
    pos = torch.tensor([list(range(5)) + list(range(7))])
    packed = m(ids[:1], TrainInputs(document_ids=doc, positions=pos)).logits
    assert (packed[0, :5] - m(ids[:1, :5]).logits[0]).abs().max() < TOL
    assert (packed[0, 5:] - m(ids[:1, 5:]).logits[0]).abs().max() < TOL


def test_sharded_roundtrip(tmp_path):
    cfg = _cfg("llama")
    m = _random_model(cfg)
    save_target(m, tmp_path, max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    m2 = load_target(tmp_path)
    ids = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, m2(ids).logits)


def test_bad_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_target(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(tmp_path / "empty")
    save_target(_random_model(_cfg("qwen3")), tmp_path / "half")
    (tmp_path / "half" / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="half-written"):
        load_target(tmp_path / "half")
    (tmp_path / "half" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_target(tmp_path / "half")
    cfg = json.loads((tmp_path / "half" / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg["model_type"] = "gpt_neox"
    (tmp_path / "half" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown architecture"):
        load_target(tmp_path / "half")
    (tmp_path / "half" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_target(tmp_path / "half")


def test_unsupported_rope_is_a_clear_error():
    with pytest.raises(ConfigError, match="rope type 'longrope' is not supported"):
        _cfg("qwen3", rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ConfigError, match="multiple of"):
        _cfg("qwen3", num_key_value_heads=3)


def test_config_roundtrip_through_hf_dict():
    for fam in FAMILIES:
        cfg = _cfg(fam, rope_scaling={"rope_type": "linear", "factor": 2.0})
        assert DecoderConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_keep_known", [False, True])
@torch.no_grad()
def test_dense_packed_verify_forward_equals_the_padded_one(family, num_keep_known):
    """keep= runs only each row's kept prefix: kept logits / taps / cache slots equal the padded forward's,
    dropped tokens write no cache slot and come back as zero logits."""
    model = _random_model(_cfg(family)).double()
    g = torch.Generator().manual_seed(3)
    B, T = 4, 6
    prompt_lens = torch.tensor([7, 3, 11, 5])

    def fresh_cache():
        cache = model.new_cache(B, 32, slack=8, dtype=torch.float64)
        ctx = torch.randint(0, 97, (B, 11), generator=torch.Generator().manual_seed(9))
        model.forward_cached(ctx, CacheInputs(cache, num_new=prompt_lens))
        return cache

    ids = torch.randint(0, 97, (B, T), generator=g)
    depth = torch.tensor([5, 0, 2, 3])  # kept tokens per row: depth + 1; row 1 keeps only its first token
    keep = torch.arange(T)[None] <= depth[:, None]
    keep[3] = False  # an idle row keeps nothing
    padded_cache, packed_cache = fresh_cache(), fresh_cache()
    before = torch.stack(packed_cache.k)  # [L, B, Hkv, S, Dh]
    ref = model.forward_cached(ids, CacheInputs(padded_cache, kv_len=24, hidden_layers=[0, 2]))
    out = model.forward_cached(ids, CacheInputs(packed_cache, kv_len=24, hidden_layers=[0, 2], keep=keep,
                                                num_keep=int(keep.sum()) if num_keep_known else None))
    torch.testing.assert_close(out.logits[keep], ref.logits[keep], rtol=1e-10, atol=1e-10)
    assert out.logits[~keep].abs().max() == 0
    for a, b in zip(out.hidden, ref.hidden, strict=True):
        torch.testing.assert_close(a[keep], b[keep], rtol=1e-10, atol=1e-10)
    assert torch.equal(packed_cache.lengths, padded_cache.lengths)
    for r in range(B):
        start, n = int(prompt_lens[r]), int(keep[r].sum())
        written = slice(start, start + n)
        torch.testing.assert_close(torch.stack(packed_cache.k)[:, r, :, written],
                                   torch.stack(padded_cache.k)[:, r, :, written])
        dropped = slice(start + n, start + T)
        assert torch.equal(torch.stack(packed_cache.k)[:, r, :, dropped], before[:, r, :, dropped])  # never written


def test_dense_packing_bad_input_is_a_clear_error():
    model = _random_model(_cfg("qwen3"))
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="keep"):  # keep packs a cached forward's tokens: no cache-free forward takes it
        model(ids, TrainInputs(keep=torch.ones(2, 3, dtype=torch.bool)))
    cache = model.new_cache(2, 8)
    with pytest.raises(ValueError, match=r"keep must be a bool tensor \[B, T\] = \[2, 3\]"):
        model.forward_cached(ids, CacheInputs(cache, keep=torch.ones(2, 4, dtype=torch.bool)))
    with pytest.raises(ValueError, match="cannot be combined"):
        model.forward_cached(ids, CacheInputs(cache, keep=torch.ones(2, 3, dtype=torch.bool),
                                              logits_index=torch.zeros(2, 1).long()))
