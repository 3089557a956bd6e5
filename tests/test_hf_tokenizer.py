"""Foreign HF tokenizer folders (Llama-3-like, Qwen3-like) against transformers' AutoTokenizer.

Each folder holds a ~400-token BPE trained in the test, with its special tokens appended after the
learned vocabulary (as real checkpoints have them, far from AngelSpec's ids 0..5), saved by
transformers' own ``save_pretrained`` so the files have exactly the layout users bring.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from angelspec.data.chat import CHAT_TEMPLATE
from angelspec.data.hf_tokenizer import ChatTemplateError, HFChatTokenizer
from angelspec.data.tokenizer import ChatTokenizer, TokenizerError, load_tokenizer, train_tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

# Llama 3 Instruct's template: BOS from the bos_token variable, trimmed contents, one header per turn.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Shaped like Qwen3's: indented tags (so trim_blocks/lstrip_blocks matter), a namespace, reasoning only
# on turns after the last user message, think blocks split out of content, and `enable_thinking is false`.
QWEN3_TEMPLATE = """{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' or message.role == 'user' %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Every helper transformers gives templates, in one place: tojson (indent, no ASCII escaping), loop
# controls, {% generation %}, namespace, dict, None-valued keys dropped, reasoning aliases, strftime_now.
FEATURE_TEMPLATE = """{%- set ns = namespace(n=0) %}
{{- '[' + strftime_now('%Y')[:2] + ']' + (bos_token | default('no-bos')) + '|' + pad_token + '\\n' }}
{%- for message in messages %}
    {%- if loop.index0 == 3 %}{% break %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    {%- if message.name is defined %}{{- 'name=' + message.name + '\\n' }}{% endif %}
    {%- if message.reasoning_content is defined %}{{- 'R:' + message.reasoning_content + '\\n' }}{% endif %}
    {%- if message.role == 'assistant' %}{% generation %}{{- message.content }}{% endgeneration %}
    {%- else %}{{- message | tojson(indent=2) }}{% endif %}
    {{- '\\n' }}
{%- endfor %}
{{- dict(n=ns.n, tools=tools, documents=documents) | tojson }}
{{- '<|im_end|>' if add_generation_prompt else '' }}
{% if add_generation_prompt %}
    <generation prompt>
{% endif %}
"""

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, how are you today? I am fine, thanks!",
    "def add(x, y):\n    return x + y * 42\n",
    "Tom has 12 apples and buys 30 more. 12 + 30 = 42.",
    "Speculative decoding drafts tokens and the target verifies them.",
    "ünïcödé text, 漢字 and emoji 🙂 appear too.",
    "You are a helpful assistant. Answer briefly.\n\nSure.",
]

LLAMA_CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "42\n\nThe answer is 42."},
        {"role": "user", "content": "ünïcödé 漢字 🙂, and a literal <|eot_id|> inside"},
    ],
]

QWEN_CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "42", "reasoning_content": "12 + 30 = 42"},
        {"role": "user", "content": "And in code?\n\n"},
    ],
    [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nDone.", "tool_calls": None},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Done again.", "reasoning": "aliased reasoning"},
    ],
]


def _bpe(pattern: str, nfc: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXTS * 3, trainer=trainer)
    return tok


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    _write_json(path, {k: v for k, v in config.items() if v is not ...})


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-3-like: BOS added by the post-processor (the template must not get a second one), and a
    truncation length in tokenizer.json (transformers ignores it unless asked to truncate)."""
    tok = _bpe(LLAMA3_PATTERN, nfc=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIALS])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    tok.enable_truncation(16)  # saved in tokenizer.json, as some checkpoints have it; chat encoding ignores it
    out = tmp_path_factory.mktemp("llama3")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                              eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE)
    hf.save_pretrained(out)
    _edit_config(out, tokenizer_class="PreTrainedTokenizerFast")
    end_of_text, eot = tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")
    _write_json(out / "config.json", {"model_type": "llama", "eos_token_id": end_of_text})
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": [end_of_text, eot]})
    return out


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-like: NFC + Qwen2 split, think tags as non-special added tokens, loaded by transformers
    through its Qwen2Tokenizer class (which rebuilds the pipeline) as real Qwen3 folders are."""
    tok = _bpe(QWEN_PATTERN, nfc=True)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<think>", "</think>")])
    out = tmp_path_factory.mktemp("qwen3")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                              chat_template=QWEN3_TEMPLATE)
    hf.save_pretrained(out)
    added = {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
             for a in json.loads((out / "tokenizer.json").read_text())["added_tokens"]}
    _edit_config(out, tokenizer_class="Qwen2Tokenizer", bos_token=None, unk_token=None, added_tokens_decoder=added,
                 split_special_tokens=False)
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    _write_json(out / "config.json", {"model_type": "qwen3", "eos_token_id": im_end})
    _write_json(out / "generation_config.json", {"eos_token_id": [im_end, eot], "pad_token_id": eot})
    return out


def _hf_ids(folder: Path, messages: list[dict], gen: bool, think: bool | None = None) -> list[int]:
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    kw = {} if think is None else {"enable_thinking": think}
    return hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, **kw)["input_ids"]


# ------------------------------------------------------------------------------------ agreement


def test_llama3_ids_match_transformers(llama_dir: Path):
    tok = load_tokenizer(llama_dir)
    assert isinstance(tok, HFChatTokenizer)
    hf = transformers.AutoTokenizer.from_pretrained(llama_dir)
    bos = tok.token_to_id("<|begin_of_text|>")
    for messages in LLAMA_CHATS:
        for gen in (False, True):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
            assert ours == hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)["input_ids"]
            assert ours.count(bos) == 1 and ours[0] == bos  # the template's BOS only, no post-processor BOS
            assert tok.render_chat_template(messages, gen) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)
    assert len(hf) == tok.vocab_size
    assert hf.bos_token_id == tok.bos_token_id == bos


def test_qwen3_ids_match_transformers(qwen_dir: Path):
    tok = load_tokenizer(qwen_dir)
    assert isinstance(tok, HFChatTokenizer)
    hf = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    assert type(hf).__name__ == "Qwen2Tokenizer"  # the class-rebuild path real Qwen3 folders take
    for messages in QWEN_CHATS:
        for gen in (False, True):
            for think in (False, True):
                kw = {"add_generation_prompt": gen, "enable_thinking": think}
                ours = tok.apply_chat_template(messages, gen, think)
                assert ours == hf.apply_chat_template(messages, tokenize=True, **kw)["input_ids"]
                assert tok.render_chat_template(messages, gen, think) == hf.apply_chat_template(
                    messages, tokenize=False, **kw)
    no_think = tok.render_chat_template(QWEN_CHATS[0])  # defaults: generation prompt, no thinking
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "R:" not in no_think and "aliased reasoning" in tok.render_chat_template(QWEN_CHATS[2], False)
    assert len(hf) == tok.vocab_size


@pytest.mark.parametrize("text", ["hello world 123", "def f(x):\n    return x\n", "ünï 漢 🙂", "<|im_start|>user\nhi",
                                  "a<think>b</think>c<|im_end|>"])
def test_encode_decode_round_trip(qwen_dir: Path, text: str):
    tok = load_tokenizer(qwen_dir)
    hf = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text == hf.decode(ids)
    # special tokens are dropped, the think tags (non-special, as in Qwen3) are kept
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert tok.encode_batch([text, "x"]) == [ids, tok.encode("x")]


def test_skip_special_tokens_follows_config_flags(qwen_dir: Path):
    tok = load_tokenizer(qwen_dir)
    ids = tok.encode("<|im_start|>a<think>b</think><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think>"
    assert tok.token_to_id("<|im_end|>") in tok.special_ids and tok.token_to_id("<think>") not in tok.special_ids
    assert tok.id_to_token(tok.token_to_id("<think>")) == "<think>"


def test_added_tokens_decoder_overrides_tokenizer_json(llama_dir: Path, tmp_path: Path):
    """The config's flags win, and a token only the config declares is appended at its declared id."""
    folder = _copy(llama_dir, tmp_path / "edited")
    spec = json.loads((folder / "tokenizer.json").read_text())
    added = {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in spec["added_tokens"]}
    for entry in spec["added_tokens"]:  # tokenizer.json says not special, the config says special
        entry["special"] = entry["content"] != "<|start_header_id|>"
    _write_json(folder / "tokenizer.json", spec)
    extra_id = spec["added_tokens"][-1]["id"] + 1
    added[str(extra_id)] = {"content": "<|extra|>", "special": True, "normalized": False}
    _edit_config(folder, added_tokens_decoder=added)
    tok, hf = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok.encode("<|start_header_id|>x<|extra|>")
    assert ids == hf.encode("<|start_header_id|>x<|extra|>", add_special_tokens=False)
    assert ids[-1] == extra_id and tok.vocab_size == len(hf) == extra_id + 1
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True) == "x"
    assert tok.decode(ids) == hf.decode(ids) == "<|start_header_id|>x<|extra|>"


def test_feature_template_matches_transformers(qwen_dir: Path, tmp_path: Path):
    folder = _copy(qwen_dir, tmp_path / "features")
    (folder / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    tok, hf = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    messages = [
        {"role": "system", "content": "Sé <b>breve</b> & \"claro\"", "name": None},
        {"role": "user", "content": "hi", "name": "ana"},
        {"role": "assistant", "content": "ok", "thinking": "from thinking"},
        {"role": "user", "content": "cut by {% break %}"},
    ]
    for gen in (False, True):
        text = tok.render_chat_template(messages, gen)
        kw = {"add_generation_prompt": gen, "enable_thinking": False}
        assert text == hf.apply_chat_template(messages, tokenize=False, **kw)
        ids = hf.apply_chat_template(messages, **kw)["input_ids"]
        assert tok.apply_chat_template(messages, gen) == ids
    assert "no-bos|<|endoftext|>" in text and "name=ana" in text and "R:from thinking" in text
    assert '"content": "Sé <b>breve</b> & \\"claro\\""' in text and "cut by" not in text
    assert '{"n": 3, "tools": null, "documents": null}' in text


def test_our_template_through_the_generic_path(tmp_path: Path):
    """Our own folder loads as ChatTokenizer, and rendering its template generically gives the same ids."""
    folder = train_tokenizer(TEXTS * 10, tmp_path / "ours", vocab_size=300)
    ours = load_tokenizer(folder)
    assert type(ours) is ChatTokenizer
    generic = HFChatTokenizer.from_folder(folder)
    assert generic.chat_template == CHAT_TEMPLATE
    assert (generic.eos_token_id, generic.pad_token_id, generic.mask_token_id) == (2, 0, 5)
    for messages in QWEN_CHATS[:2]:
        for gen in (False, True):
            for think in (False, True):
                expected = ours.apply_chat_template(messages, gen, think)
                assert generic.apply_chat_template(messages, gen, think) == expected


# ------------------------------------------------------------------------------------ special ids


def test_eos_and_pad_ids(llama_dir: Path, qwen_dir: Path, tmp_path: Path):
    llama = load_tokenizer(llama_dir)
    eot, end_of_text = llama.token_to_id("<|eot_id|>"), llama.token_to_id("<|end_of_text|>")
    assert eot > 300 and end_of_text > 300  # far from AngelSpec's fixed ids
    assert (llama.eos_token_id, llama.pad_token_id, llama.mask_token_id) == (eot, eot, None)  # pad falls back to eos
    assert llama.eos_token_ids == (eot, end_of_text)  # generation_config.json's list, tokenizer eos first
    qwen = load_tokenizer(qwen_dir)
    im_end, endoftext = qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")
    assert (qwen.eos_token_id, qwen.pad_token_id, qwen.bos_token_id) == (im_end, endoftext, None)
    assert qwen.eos_token_ids == (im_end, endoftext)

    folder = _copy(llama_dir, tmp_path / "no_gen")
    (folder / "generation_config.json").unlink()
    assert load_tokenizer(folder).eos_token_ids == (eot, end_of_text)  # config.json's int
    _write_json(folder / "config.json", {"text_config": {"eos_token_id": [eot, 7]}})
    assert load_tokenizer(folder).eos_token_ids == (eot, 7)
    (folder / "config.json").unlink()
    assert load_tokenizer(folder).eos_token_ids == (eot,)
    _edit_config(folder, eos_token=...)  # no eos anywhere
    with pytest.raises(TokenizerError, match="no eos token"):
        load_tokenizer(folder)
    _write_json(folder / "generation_config.json", {"eos_token_id": end_of_text})
    assert load_tokenizer(folder).eos_token_id == end_of_text


def test_special_tokens_map_is_legacy_fallback(llama_dir: Path, tmp_path: Path):
    folder = _copy(llama_dir, tmp_path / "legacy")
    _edit_config(folder, eos_token=..., bos_token=...)
    _write_json(folder / "special_tokens_map.json", {
        "bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
        "eos_token": "<|eot_id|>",
    })
    tok = load_tokenizer(folder)
    assert (tok.bos_token_id, tok.eos_token_id) == (tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|eot_id|>"))


# ------------------------------------------------------------------------------------ template sources


def test_template_sources(llama_dir: Path, tmp_path: Path):
    expected = load_tokenizer(llama_dir).apply_chat_template(LLAMA_CHATS[1])
    as_string = _copy(llama_dir, tmp_path / "string")
    (as_string / "chat_template.jinja").unlink()
    _edit_config(as_string, chat_template=LLAMA3_TEMPLATE)
    as_list = _copy(llama_dir, tmp_path / "list")
    (as_list / "chat_template.jinja").unlink()
    _edit_config(as_list, chat_template=[{"name": "tool_use", "template": "{{ raise_exception('wrong one') }}"},
                                         {"name": "default", "template": LLAMA3_TEMPLATE}])
    jinja_wins = _copy(llama_dir, tmp_path / "both")
    _edit_config(jinja_wins, chat_template="{{ raise_exception('the .jinja file should win') }}")
    for folder in (as_string, as_list, jinja_wins):
        assert load_tokenizer(folder).apply_chat_template(LLAMA_CHATS[1]) == expected


# ------------------------------------------------------------------------------------ errors


def test_missing_template_is_a_clear_error(llama_dir: Path, tmp_path: Path):
    folder = _copy(llama_dir, tmp_path / "base_model")
    (folder / "chat_template.jinja").unlink()
    tok = load_tokenizer(folder)  # plain text still works
    assert tok.decode(tok.encode("hello world")) == "hello world"
    with pytest.raises(TokenizerError, match=r"base_model has no chat template .*encode\(\).*chat_template"):
        tok.apply_chat_template(LLAMA_CHATS[0])


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda f: (f / "chat_template.jinja").write_text("{% for m in messages %}"), r"chat_template\.jinja: .*parse"),
        (lambda f: (f / "chat_template.jinja").unlink() or _edit_config(
            f, chat_template=[{"name": "tool_use", "template": "x"}]), "none named 'default'"),
        (lambda f: (f / "generation_config.json").write_text("{oops"), r"cannot read .*generation_config\.json"),
        (lambda f: _write_json(f / "generation_config.json", {"eos_token_id": "2"}), "eos_token_id must be"),
        (lambda f: _edit_config(f, eos_token="<|not_a_token|>"), "eos_token '<|not_a_token|>' is not in the vocab"),
        (lambda f: _edit_config(f, bos_token={"content": 3}), "bos_token must be a string"),
        (lambda f: _edit_config(f, added_tokens_decoder={"5": {"content": "<|eot_id|>", "special": True}}),
         "different tokenizers"),
        (lambda f: _edit_config(f, added_tokens_decoder={"9999": {"content": "<|new|>"}}), "next free id"),
        (lambda f: (f / "tokenizer.json").write_text('{"model": 1}'), r"cannot parse .*tokenizer\.json"),
    ],
)
def test_broken_folders_are_refused(llama_dir: Path, tmp_path: Path, edit, match: str):
    folder = _copy(llama_dir, tmp_path / "broken")
    edit(folder)
    with pytest.raises(TokenizerError, match=match):
        load_tokenizer(folder)


def test_bad_conversations(qwen_dir: Path):
    qwen = load_tokenizer(qwen_dir)
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        qwen.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="empty"):
        qwen.apply_chat_template([])
    with pytest.raises(ValueError, match="message 1 must be a dict"):
        qwen.apply_chat_template([{"role": "user", "content": "a"}, "b"])
    with pytest.raises(ChatTemplateError, match="cannot render"):  # content blocks the template cannot concatenate
        qwen.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


# ------------------------------------------------------------------------------------ end to end


def test_generate_accepts_a_foreign_checkpoint(qwen_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """`angelspec generate --target` on a Qwen3-like folder (random 1-layer decoder beside the tokenizer)."""
    import torch

    from angelspec.cli import main
    from angelspec.models import Decoder, DecoderConfig, save_target

    folder = _copy(qwen_dir, tmp_path / "qwen3_ckpt")
    tok = load_tokenizer(folder)
    config = DecoderConfig(
        vocab_size=tok.vocab_size + 3, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
        model_type="qwen3", eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model = Decoder(config)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_target(model, folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": QWEN_CHATS[1]}) + "\n")
    out = tmp_path / "o.jsonl"
    code = main(["generate", "--target", str(folder), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "3", "--quiet"])
    assert code == 0, capsys.readouterr().err
    row = json.loads(out.read_text())
    assert 1 <= len(row["token_ids"]) <= 3 and isinstance(row["completion"], str)
