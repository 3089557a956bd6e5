"""Shared fixtures. `tiny_target_dir` is a complete target folder (weights, config, tokenizer with chat
template) small enough that CLI, engine and demo tests never need the real embedded model."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

TINY_VOCAB = 300
TINY_CONTEXT = 256

_SUBJECTS = ["the cache", "a drafter", "the target", "my function", "this loop", "the tokenizer", "a request"]
_VERBS = ["returns", "accepts", "rejects", "stores", "prints", "computes", "reads"]
_OBJECTS = ["a list of tokens", "the answer", "three apples", "the next word", "a small number", "every row"]


def synthetic_sentences(n: int, seed: int = 0) -> Iterator[str]:
    """Code-, maths- and chat-flavoured lines, so the tiny BPE learns merges for all three domains."""
    rng = random.Random(seed)
    for i in range(n):
        kind = i % 3
        if kind == 0:
            name = rng.choice(["add", "scale", "merge", "count"])
            yield f"def {name}(x, y):\n    return x + y * {rng.randint(0, 99)}\n"
        elif kind == 1:
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            yield f"Tom has {a} apples and buys {b} more. {a} + {b} = {a + b}. The answer is {a + b}."
        else:
            yield f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen3 decoder plus a ~300-token byte-level BPE tokenizer in one HF-layout folder."""
    import torch

    from angelspec.data.tokenizer import load_tokenizer, train_tokenizer
    from angelspec.models import Decoder, DecoderConfig, save_target

    out = tmp_path_factory.mktemp("tiny_target")
    train_tokenizer(synthetic_sentences(400), out, vocab_size=TINY_VOCAB)
    tok = load_tokenizer(out)
    config = DecoderConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=TINY_CONTEXT,
        model_type="qwen3", eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model = Decoder(config)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_target(model, out)
    return out


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: a second intra-op thread only adds sync overhead, and on a shared 2-core machine a busy
    core makes OpenMP barriers spin (measured 20x slower). Restored afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
