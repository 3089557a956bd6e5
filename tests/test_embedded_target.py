"""The shipped embedded target is a complete HF folder: transformers loads it (model and tokenizer) and
agrees with our decoder, and it is a real model (greedy code answers look like Python)."""

from __future__ import annotations

import pytest
import torch

from angelspec.assets import DEFAULT_TARGET

pytestmark = pytest.mark.skipif(not (DEFAULT_TARGET / "config.json").is_file(),
                                reason="the embedded target is not built in this checkout")


@pytest.fixture(scope="module")
def ours():
    from angelspec.models import load_target

    return load_target(DEFAULT_TARGET)


def test_transformers_loads_the_folder_and_agrees(ours):
    transformers = pytest.importorskip("transformers")
    from angelspec.data.tokenizer import load_tokenizer

    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    tok = load_tokenizer(DEFAULT_TARGET)
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert ids == hf_tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                             tokenize=True, return_dict=True)["input_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        assert (hf(x).logits - ours(x).logits).abs().max() < 1e-3


def test_greedy_code_answer_looks_like_python(ours):
    from angelspec.data.tokenizer import load_tokenizer
    from angelspec.train.target import greedy_complete

    tok = load_tokenizer(DEFAULT_TARGET)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function `add(a, b)` that returns "
                                    "the sum of a and b."}], add_generation_prompt=True, enable_thinking=False)
    text = tok.decode(greedy_complete(ours, ids, 48, ours.config.eos_token_ids), skip_special_tokens=True)
    assert text.lstrip().startswith("def ") and "(" in text
    assert len(set(text.split())) > 5  # not a loop of one token
