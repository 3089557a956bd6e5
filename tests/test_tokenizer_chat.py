"""Tokenizer folder, chat template and loss masks on a ~300-token BPE trained in the test."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from angelspec.data.chat import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    encode_conversation,
    render_chat,
)
from angelspec.data.tokenizer import ChatTokenizer, TokenizerError, load_tokenizer, train_tokenizer

VOCAB = 300


def _texts(n: int = 300):
    rng = random.Random(0)
    words = "the a model token code chat answer question python def return value list is of to and in".split()
    for i in range(n):
        yield " ".join(rng.choice(words) for _ in range(12)) + f". {i} + {i} = {2 * i}\n\n"
        yield f"def f{i}(x):\n    return x * {i}\n"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(_texts(), tmp_path_factory.mktemp("tok"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> ChatTokenizer:
    return load_tokenizer(tok_dir)


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "12 + 30 = 42\nThe answer is 42."},
        {"role": "user", "content": "And in code?\n\n"},
        {"role": "assistant", "content": "```python\nprint(12 + 30)\n```"},
    ],
    [
        {"role": "user", "content": "\n\nLeading newlines"},
        {"role": "assistant", "content": "\n\nand here too, plus ünïcödé 漢字 and tabs\t."},
    ],
    [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning_content": "Let me think.\nOK."},
    ],
    [{"role": "user", "content": "Only a prompt"}],
]


# ------------------------------------------------------------------------------------ tokenizer


def test_special_token_ids_and_flags(tok: ChatTokenizer):
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(6))
    assert (tok.pad_token_id, tok.im_start_id, tok.eos_token_id, tok.mask_token_id) == (0, 1, 2, 5)
    assert (tok.think_start_id, tok.think_end_id) == (3, 4)
    assert tok.vocab_size == len(tok) == VOCAB
    # special strings become single ids; think tags survive skip_special_tokens (as in Qwen3)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><think>x</think><|mask|>")
    assert ids[0] == 1 and 2 in ids and 3 in ids and 4 in ids and ids[-1] == 5
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi<think>x</think>"


@pytest.mark.parametrize(
    "text",
    ["hello world", "  two  spaces\n\n\nnewlines\t tab", "def f(x):\n    return x * 3\n", "ünïcödé 漢字 🙂", "12345"],
)
def test_round_trip(tok: ChatTokenizer, text: str):
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_split(tok: ChatTokenizer):
    assert len(tok.encode("12345")) == 5
    assert tok.encode_batch(["1 2", "ab"]) == [tok.encode("1 2"), tok.encode("ab")]


def test_folder_files(tok_dir: Path):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    tokens = (config["eos_token"], config["pad_token"], config["mask_token"])
    assert tokens == ("<|im_end|>", "<|endoftext|>", "<|mask|>")
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (tok_dir / "special_tokens_map.json").is_file()


def test_autotokenizer_agrees(tok_dir: Path, tok: ChatTokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    assert (hf.eos_token_id, hf.pad_token_id, hf.mask_token_id) == (2, 0, 5)
    assert len(hf) == tok.vocab_size
    for text in ["hello world 123", "def f(x):\n    return x\n", "<|im_start|>user\nhi<|im_end|>\n", "ünï 漢"]:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
        assert hf.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    for messages in CONVERSATIONS:
        for think in (False, True):
            for gen in (False, True):
                kw = {"add_generation_prompt": gen, "enable_thinking": think}
                assert hf.apply_chat_template(messages, tokenize=False, **kw) == render_chat(messages, gen, think)
                ids = hf.apply_chat_template(messages, add_generation_prompt=gen, enable_thinking=think)["input_ids"]
                assert ids == tok.apply_chat_template(messages, gen, think)
    # no flag at all means no-think, like our default
    assert hf.apply_chat_template(CONVERSATIONS[0], tokenize=False) == render_chat(CONVERSATIONS[0])
    with pytest.raises(Exception, match="Unknown chat role"):
        hf.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_train_rejects_tiny_vocab(tmp_path: Path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], tmp_path, vocab_size=200)


def test_load_errors_name_the_problem(tmp_path: Path, tok_dir: Path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(TokenizerError, match="tokenizer.json is missing"):
        load_tokenizer(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text((tok_dir / "tokenizer_config.json").read_text())
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"cannot parse .*broken/tokenizer\.json"):
        load_tokenizer(broken)
    (broken / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (broken / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer_config.json is missing"):
        load_tokenizer(broken)
    (broken / "tokenizer_config.json").write_text("[1,")
    with pytest.raises(TokenizerError, match="cannot read"):
        load_tokenizer(broken)
    # a tokenizer whose special tokens sit at other ids is refused
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["<|mask|>"], vocab["<|im_end|>"] = vocab["<|im_end|>"], vocab["<|mask|>"]
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    (broken / "tokenizer.json").write_text(json.dumps(spec))
    (broken / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="has id 5, expected 2"):
        load_tokenizer(broken)


# ------------------------------------------------------------------------------------ chat format


def test_render_chat_exact():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    head = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert render_chat(msgs) == head + "<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n"
    assert render_chat(msgs, enable_thinking=True) == head + "<|im_start|>assistant\nA<|im_end|>\n"
    reasoning = [*msgs[:2], {**msgs[2], "reasoning_content": "R"}]
    assert render_chat(reasoning, enable_thinking=True) == (
        head + "<|im_start|>assistant\n<think>\nR\n</think>\n\nA<|im_end|>\n"
    )
    assert render_chat(reasoning) == render_chat(msgs)  # no-think mode ignores reasoning
    assert render_chat(msgs[:2], add_generation_prompt=True) == head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert render_chat(msgs[:2], True, True) == head + "<|im_start|>assistant\n"


def test_jinja_template_matches_render_chat():
    jinja2 = pytest.importorskip("jinja2")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(CHAT_TEMPLATE)
    for messages in CONVERSATIONS:
        for think in (False, True):
            for gen in (False, True):
                got = template.render(messages=messages, add_generation_prompt=gen, enable_thinking=think)
                assert got == render_chat(messages, gen, think)


# ------------------------------------------------------------------------------------ loss masks


def _masked_text(tok: ChatTokenizer, ids: list[int], mask: list[int], value: int) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m == value])


@pytest.mark.parametrize("messages", CONVERSATIONS[:4])
@pytest.mark.parametrize("think", [False, True])
def test_loss_mask_is_exact(tok: ChatTokenizer, messages: list[dict], think: bool):
    enc = encode_conversation(tok, messages, enable_thinking=think)
    assert enc.num_truncated == 0 and not enc.truncated
    assert len(enc.ids) == len(enc.loss_mask) and set(enc.loss_mask) <= {0, 1}
    # ids equal whole-string tokenization of the rendered conversation (what inference will see)
    assert enc.ids == tok.encode(render_chat(messages, False, think))
    expected = ""
    for m in messages:
        if m["role"] == "assistant":
            if think and m.get("reasoning_content"):
                expected += f"<think>\n{m['reasoning_content']}\n</think>\n\n"
            expected += m["content"] + "<|im_end|>"
    got = _masked_text(tok, enc.ids, enc.loss_mask, 1)
    if any(m["role"] == "assistant" and m["content"][:1] == "\n" for m in messages):
        # documented straddle: the header's newline run merges with the content's leading newlines
        assert got.endswith(expected) and got[: len(got) - len(expected)].strip("\n") == ""
    else:
        assert got == expected
    # one contiguous trained run per assistant turn, each ending on <|im_end|>
    runs = [i for i in range(len(enc.ids)) if enc.loss_mask[i] and (i + 1 == len(enc.ids) or not enc.loss_mask[i + 1])]
    assert len(runs) == sum(m["role"] == "assistant" for m in messages)
    assert all(enc.ids[i] == tok.eos_token_id for i in runs)
    # headers and the empty think block of no-think mode are never trained on
    untrained = _masked_text(tok, enc.ids, enc.loss_mask, 0)
    assert untrained.count("assistant\n") == len(runs)
    if not think:
        assert untrained.count("<think>\n\n</think>\n\n") == len(runs)


@pytest.mark.parametrize("think", [False, True])
def test_training_ids_match_inference_prompt(tok: ChatTokenizer, think: bool):
    """Prompt encoded alone (as at inference) + content encoded alone == the training sequence."""
    messages = CONVERSATIONS[1]
    enc = encode_conversation(tok, messages, enable_thinking=think)
    pieces: list[int] = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:k], add_generation_prompt=True, enable_thinking=think)
        assert enc.ids[: len(prompt)] == prompt
        pieces = prompt + tok.encode(m["content"]) + [tok.eos_token_id]
        assert enc.ids[: len(pieces)] == pieces
        assert enc.loss_mask[len(prompt) : len(pieces)] == [1] * (len(pieces) - len(prompt))
        assert not any(enc.loss_mask[: len(prompt)][-3:])
    assert len(enc.ids) == len(pieces) + 1  # the final "\n" after <|im_end|>


def test_mask_works_through_wrapper_and_hf(tok_dir: Path, tok: ChatTokenizer):
    ref = encode_conversation(tok, CONVERSATIONS[1])
    assert tok.encode_conversation(CONVERSATIONS[1]) == ref
    assert encode_conversation(tok.backend, CONVERSATIONS[1]) == ref
    transformers = pytest.importorskip("transformers")
    assert encode_conversation(transformers.AutoTokenizer.from_pretrained(tok_dir), CONVERSATIONS[1]) == ref


def test_truncation_is_reported(tok: ChatTokenizer):
    full = encode_conversation(tok, CONVERSATIONS[1])
    cut = encode_conversation(tok, CONVERSATIONS[1], max_length=10)
    assert cut.ids == full.ids[:10] and cut.loss_mask == full.loss_mask[:10]
    assert cut.num_truncated == len(full.ids) - 10 and cut.truncated
    assert encode_conversation(tok, CONVERSATIONS[1], max_length=len(full.ids)).num_truncated == 0


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "user", "content": "hi"}], "no assistant message"),
        ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}], "message 1 has unknown role 'robot'"),
        (["hello", {"role": "assistant", "content": "x"}], "message 0 must be a dict"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}], "message 1 .*content must be a str"),
        ([{"role": "user", "content": "a<|im_end|>"}, {"role": "assistant", "content": "b"}], "control token"),
        ([], "empty"),
        ("user: hi", "must be a list"),
    ],
)
def test_bad_conversations_are_rejected(tok: ChatTokenizer, messages, match: str):
    with pytest.raises(ValueError, match=match):
        encode_conversation(tok, messages)
