"""The attention switch as a user reaches it (`--attention`, `Placement.attention`, the process default that
"auto" resolves to) and the static decode shapes behind CUDA graphs: under flex a cached forward never reads
`kv_len`, so one compiled graph serves every step; the CUDA-graph options and the engine switch; TTT's prefix
attention through FlexAttention (forward here, gradients on a GPU: tests/test_attention_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bad_input, run_cli, write_conversations

from angelspec.errors import UsageError
from angelspec.models import Decoder, DecoderConfig, few_rows
from angelspec.models.attention import (
    cache_span,
    compiled_flex_attention,
    document_first_index,
    resolve_attention_backend,
    set_attention_backend,
    set_default_attention_backend,
)
from angelspec.models.decoder import CacheInputs
from angelspec.models.device import resolve_placement


@pytest.fixture
def default_backend():
    yield
    set_default_attention_backend("auto")


def _decoder() -> Decoder:
    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Decoder(cfg)
    model.init_weights(std=0.3)
    return model.eval()


def test_placement_carries_the_attention_and_auto_follows_it(default_backend) -> None:
    where = resolve_placement("cpu", "float32", "flex")
    assert where.attention == "flex" and resolve_placement("cpu").attention == "auto"
    model = _decoder()
    cpu = "native" if few_rows.attention_op() is not None else "sdpa"
    assert resolve_attention_backend(model.attn_backend, torch.device("cpu")) == cpu
    where.use_attention()  # what every command does before it loads a model
    assert resolve_attention_backend(model.attn_backend, torch.device("cpu")) == "flex"
    set_attention_backend(model, "expand")  # a module's own choice wins over the default
    assert resolve_attention_backend(model.attn_backend, torch.device("cpu")) == "expand"
    resolve_placement("cpu", attention="auto").use_attention()
    assert resolve_attention_backend("auto", torch.device("cpu")) == cpu
    with pytest.raises(UsageError, match="attention 'flash' is not a backend; use one of auto, sdpa, native, flex"):
        resolve_placement("cpu", attention="flash")


def test_a_misspelt_attention_flag_is_one_line(capsys, tmp_path, tiny_target_dir) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    code, _, err = run_cli(capsys, "generate", "--prompts", prompts, "--out", tmp_path / "out.jsonl",
                           "--target", tiny_target_dir, "--attention", "flash")
    assert_bad_input(code, err, "attention 'flash'", "auto, sdpa, native, flex, expand")
    assert not (tmp_path / "out.jsonl").exists()


def test_training_with_flex_on_a_cpu_is_refused_before_any_step(capsys, tmp_path, tiny_target_dir,
                                                                 default_backend) -> None:
    data = write_conversations(tmp_path / "conv.jsonl", 8, seed=0)
    code, _, err = run_cli(capsys, "train", "--drafter", "mtp", "--data", data, "--out", tmp_path / "run",
                           "--target", tiny_target_dir, "--device", "cpu", "--attention", "flex")
    assert_bad_input(code, err, "--attention flex", "GPU")
    assert not (tmp_path / "run" / "training" / "checkpoint").exists()


def test_cache_span_is_the_whole_capacity_under_flex() -> None:
    cpu = torch.device("cpu")
    assert cache_span(10, 64, "sdpa", cpu) == 10 and cache_span(100, 64, "sdpa", cpu) == 64
    assert cache_span(None, 64, "sdpa", cpu) == 64 and cache_span(10, 64, "flex", cpu) == 64
    assert cache_span(10, 64, "auto", torch.device("cuda")) == 64


def _graphs_per_kv_len(model: Decoder, backend: str) -> tuple[int, list[torch.Tensor]]:
    """Compile a cached decode step with static shapes and call it at three kv_len bounds: (graphs, logits)."""
    set_attention_backend(model, backend)
    compiled_flex_attention()  # built once per process, before any compiled step (its first build is a global write)
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lambda t, c, n: model.forward_cached(t, CacheInputs(c, kv_len=n)).logits, backend=count,
                         dynamic=False)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 64, (2, 6), generator=g)
    cache = model.new_cache(2, 40)
    out = []
    with torch.no_grad():
        model.forward_cached(prompt, CacheInputs(cache, kv_len=6))
        for n in (7, 8, 9):
            out.append(step(torch.randint(0, 64, (2, 1), generator=g), cache, n))
    torch._dynamo.reset()
    return len(graphs), out


def test_under_flex_one_graph_serves_every_decode_step() -> None:
    """The CUDA-graph precondition: with flex the step's graph does not depend on kv_len (one graph for three
    bounds), where the masked path is traced again for each bound; both give the same logits."""
    model = _decoder()
    n_flex, flex = _graphs_per_kv_len(model, "flex")
    n_sdpa, sdpa = _graphs_per_kv_len(model, "sdpa")
    assert n_flex == 1 and n_sdpa > 1
    for a, b in zip(flex, sdpa, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cuda_graph_options_and_the_engine_switch() -> None:
    from angelspec.decoding.compiled import compile_options, static_attention
    from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
    from angelspec.decoding.sampling import SamplingParams

    assert compile_options(True) == {"triton.cudagraphs": True} and compile_options(False) == {}
    model = _decoder()
    set_attention_backend(model, "flex")
    assert not static_attention(model)  # CUDA graphs exist on CUDA only
    cache = model.new_cache(2, 8)
    cache.mark_static_address()  # a no-op for eager code on any device
    reqs = [Request(prompt_ids=[1, 2, 3], max_new_tokens=6, sampling=SamplingParams(temperature=0.0), request_id=0)]
    set_attention_backend(model, "auto")
    plain = SpecEngine(model, config=EngineConfig(max_batch_size=1)).generate(reqs)
    graphs = SpecEngine(model, config=EngineConfig(max_batch_size=1, cuda_graphs=True))
    assert not graphs.forwards.cuda_graphs  # without compile (and off CUDA) the switch changes nothing
    assert graphs.generate(reqs)[0].token_ids == plain[0].token_ids


def test_ttt_prefix_attention_through_flex_equals_the_tiled_kernel() -> None:
    from angelspec.train.ttt import ttt_attention

    g = torch.Generator().manual_seed(5)
    B, H, Hkv, T, Dh = 2, 4, 2, 200, 16
    q = torch.randn(B, H, T, Dh, generator=g)
    k0, v0 = torch.randn(B, Hkv, T, Dh, generator=g), torch.randn(B, Hkv, T, Dh, generator=g)
    diag_k = [torch.randn(B, Hkv, T, Dh, generator=g) for _ in range(2)]
    diag_v = [torch.randn(B, Hkv, T, Dh, generator=g) for _ in range(2)]
    doc = (torch.arange(T) >= 90).long().repeat(B, 1)
    doc[1, 40:] += 3
    first = document_first_index(doc)
    with torch.no_grad():
        tiled = ttt_attention(q, k0, v0, diag_k, diag_v, doc, first, backend="sdpa")
        flex = ttt_attention(q, k0, v0, diag_k, diag_v, doc, first, backend="flex")
    torch.testing.assert_close(flex, tiled, atol=1e-5, rtol=1e-5)


def test_greedy_speculative_under_flex_equals_ar() -> None:
    """The engine end to end with the target on FlexAttention (compiled kernel, cache-wide block masks: the path
    `auto` takes on a GPU): speculative decoding with prompt lookup equals plain AR under the masked path."""
    from angelspec.decoding.drafters.ngram import NGramDrafter
    from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
    from angelspec.decoding.sampling import SamplingParams

    model = _decoder()
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() * 2 for n in (5, 9)]  # repeats for the lookup
    reqs = [Request(prompt_ids=p, max_new_tokens=12, sampling=greedy, request_id=i) for i, p in enumerate(prompts)]
    set_attention_backend(model, "sdpa")
    ar = SpecEngine(model, config=EngineConfig(max_batch_size=2, max_seq_len=64)).generate(reqs)
    set_attention_backend(model, "flex")
    spec = SpecEngine(model, drafter=NGramDrafter(max_ngram=2),
                      config=EngineConfig(max_batch_size=2, max_seq_len=64, num_draft_tokens=3)).generate(reqs)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
