"""Load any Hugging Face fast-tokenizer folder (Qwen3, Llama 3, Qwen2, ...) without importing transformers.

Users point AngelSpec at their own checkpoint folder, so the target's tokenizer is whatever that folder
holds: ``tokenizer.json`` (the ``tokenizers`` serialization), ``tokenizer_config.json`` (named special
tokens, added-token flags, usually the chat template) and optionally ``chat_template.jinja``,
``special_tokens_map.json``, ``generation_config.json`` and ``config.json``. :class:`HFChatTokenizer`
reads them the way transformers 5.24 does and exposes the same interface as
:class:`~angelspec.data.tokenizer.ChatTokenizer`, so the engine, the CLI and the trainers need not care
which one they hold. transformers stays an optional dependency: it is 10x slower to import than this
module, and nothing here needs its model code.

What matches transformers 5.24 (tests compare ids with ``AutoTokenizer.apply_chat_template``):

- The chat template is rendered by jinja2 in an ``ImmutableSandboxedEnvironment`` with
  ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a no-op ``{% generation %}`` tag,
  and the ``raise_exception`` / ``strftime_now`` globals and ``tojson`` filter templates rely on. It sees
  ``messages``, ``add_generation_prompt``, ``enable_thinking``, ``tools=None``, ``documents=None`` and
  every named special token as a string (``bos_token``, ``eos_token``, ...).
- Messages are normalised first: keys whose value is None are dropped (templates test ``is defined``),
  and ``reasoning_content`` / ``thinking`` / ``reasoning`` are aliased to each other.
- The rendered text is encoded with ``add_special_tokens=False``: the template writes BOS and turn
  tokens itself, so the post-processor must not add a second BOS. Truncation and padding stored in
  ``tokenizer.json`` are switched off, as transformers does for every call without ``truncation=``.
- ``chat_template.jinja`` wins over ``tokenizer_config.json``'s ``chat_template``; a list of
  ``{name, template}`` entries (or a dict) uses the one named ``"default"``.
- ``added_tokens_decoder`` entries override the flags in ``tokenizer.json`` (e.g. ``special``, which
  decides what ``skip_special_tokens`` drops), and ``split_special_tokens`` is honoured.

Where this module deliberately differs, see :class:`HFChatTokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from angelspec.data.chat import check_message_list
from angelspec.data.tokenizer_base import (
    CONFIG_FILE,
    SPECIAL_MAP_FILE,
    TOKENIZER_FILE,
    BackendTokenizer,
    TokenizerError,
    read_json_config,
    read_tokenizer_folder,
)

CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
# Named special tokens transformers passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS: tuple[str, ...] = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)
# Names a message's reasoning may come under; templates read `reasoning_content` (gpt-oss: `thinking`).
REASONING_KEYS: tuple[str, ...] = ("reasoning_content", "thinking", "reasoning")
ADDED_TOKEN_FLAGS: tuple[str, ...] = ("single_word", "lstrip", "rstrip", "normalized", "special")
# Chat templates are code from the checkpoint's author; jinja2 < 3.1.6 has known sandbox escapes.
MIN_JINJA2 = (3, 1, 6)


class ChatTemplateError(ValueError):
    """The chat template refused a conversation (its own ``raise_exception``, or a type it cannot render)."""


class HFChatTokenizer(BackendTokenizer):
    """A Hugging Face tokenizer folder behind :class:`~angelspec.data.tokenizer.ChatTokenizer`'s interface.

    ``encode`` / ``encode_batch`` never add BOS/EOS (special-token strings in the text still become
    their ids), so ids are exactly what the chat template or the caller wrote.

    Deliberate differences from transformers 5.24:

    - ``tokenizer.json`` is used as written. transformers rebuilds the pipeline of some classes
      (``Qwen2Tokenizer``, ``LlamaTokenizer``, ...) from vocab and merges with the class's own normalizer
      and pre-tokenizer; for current Qwen2/Qwen3/Llama 3 folders the two agree (a test covers the
      ``Qwen2Tokenizer`` path), but an old folder whose ``tokenizer.json`` disagrees with its class
      would tokenize as its file says here.
    - A named ``eos_token`` / ``bos_token`` that is not in the vocabulary is an error; transformers
      would append it as a new id that the model's embedding table has never seen. A missing
      ``pad_token`` falls back to the eos id instead of being appended.
    - Only the files count: class defaults are not applied (``Qwen2Tokenizer`` assumes ``<|endoftext|>``
      for eos, pad and unk when the config omits them); a missing eos falls back to the first eos id of
      ``generation_config.json`` / ``config.json`` instead.
    - ``clean_up_tokenization_spaces`` is ignored; transformers 5.24 ignores it too for BPE models
      (all Qwen and Llama tokenizers), and only applies it to WordPiece-style ones.
    - Control tokens typed inside messages are encoded as control tokens (transformers' default,
      ``sanitize_control_tokens=False``); prompts files are trusted input.
    """

    def __init__(self, backend: Tokenizer, path: Path, config: Mapping[str, Any]) -> None:
        self.backend = backend
        self.path = path
        max_len = config.get("model_max_length")
        self.model_max_length: int | None = max_len if isinstance(max_len, int) else None
        # transformers disables both on every call that does not ask for them; a tokenizer.json with
        # truncation saved in it would otherwise silently cut long prompts.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        _apply_added_tokens(backend, config.get("added_tokens_decoder"), path / CONFIG_FILE)

        self.special_tokens = _named_special_tokens(path, config)
        self.template_vars = {**_model_specific_tokens(config), **self.special_tokens}
        self.generation_eos_ids = _generation_eos_ids(path)
        ids = {name: self._named_id(name) for name in self.special_tokens}
        eos = ids.get("eos_token")
        if eos is None:
            if not self.generation_eos_ids:
                raise TokenizerError(f"{path}: no eos token: {CONFIG_FILE} has no eos_token and neither "
                                     f"{GENERATION_CONFIG_FILE} nor {MODEL_CONFIG_FILE} has an eos_token_id")
            eos = self.generation_eos_ids[0]
        self.eos_token_id: int = eos
        self.bos_token_id: int | None = ids.get("bos_token")
        self.pad_token_id: int = ids["pad_token"] if ids.get("pad_token") is not None else eos
        self.mask_token_id: int | None = ids.get("mask_token")
        self.chat_template: str | None = _chat_template_source(path, config)
        self._template = _compile_template(self.chat_template, path) if self.chat_template is not None else None

    @classmethod
    def from_folder(cls, path: str | Path) -> HFChatTokenizer:
        """Load ``path`` as a HF folder even if it is in AngelSpec's own layout (``load_tokenizer`` would
        give a :class:`~angelspec.data.tokenizer.ChatTokenizer` for that)."""
        folder = Path(path)
        backend, config = read_tokenizer_folder(folder)
        return cls(backend, folder, config)

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens[name]
        token_id = self.backend.token_to_id(token)
        if token_id is None and name in ("eos_token", "bos_token"):
            raise TokenizerError(f"{self.path / CONFIG_FILE}: {name} {token!r} is not in the vocabulary of "
                                 f"{self.path / TOKENIZER_FILE}; the files belong to different tokenizers")
        return token_id

    # ------------------------------------------------------------------------------ vocabulary
    @property
    def special_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
        return frozenset(i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a reply: the tokenizer's eos first, then ``generation_config.json``'s
        (``config.json``'s when there is none). Chat models often stop on several, e.g. Llama 3
        Instruct on ``<|eot_id|>`` and ``<|end_of_text|>``."""
        return tuple(dict.fromkeys((self.eos_token_id, *self.generation_eos_ids)))

    # ------------------------------------------------------------------------------ chat
    def render_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
    ) -> str:
        """The conversation as text, equal to transformers' ``apply_chat_template(..., tokenize=False)``
        (:meth:`apply_chat_template` encodes it).

        ``enable_thinking`` is always passed to the template (as AngelSpec's own template expects), so a
        Qwen3 template, which thinks when the flag is absent, gets no-think unless asked.

        Raises:
            TokenizerError: the folder has no chat template.
            ChatTemplateError: the template refused the conversation.
            ValueError: ``messages`` is not a non-empty list of dicts.
        """
        if self._template is None:
            raise TokenizerError(
                f"tokenizer folder {self.path} has no chat template (no chat_template in {CONFIG_FILE} and no "
                f"{CHAT_TEMPLATE_FILE}), so chat messages cannot be rendered; encode plain text with encode() "
                "instead, or add the model's chat_template to the folder"
            )
        import jinja2

        chat = template_messages(messages)
        try:
            return self._template.render(
                **self.template_vars,
                enable_thinking=enable_thinking,
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except (jinja2.TemplateError, TypeError) as exc:
            raise ChatTemplateError(f"{self.path}: the chat template cannot render this conversation: {exc}") from None

    def __repr__(self) -> str:
        return f"HFChatTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """Copy a conversation into what transformers hands the template: None-valued keys dropped and the
    reasoning aliases filled. Roles and content types are the template's business (tool turns, content
    block lists), so only the outer shape is checked here."""
    out: list[dict[str, Any]] = []
    for msg in check_message_list(messages):
        chat_msg = {key: value for key, value in msg.items() if value is not None}
        reasoning = next((chat_msg[key] for key in REASONING_KEYS if key in chat_msg), None)
        if reasoning is not None:
            chat_msg = {"thinking": reasoning, **chat_msg, "reasoning_content": reasoning}
        out.append(chat_msg)
    return out


# ------------------------------------------------------------------------------------ folder files


def _read_optional_json(path: Path) -> dict[str, Any] | None:
    return read_json_config(path) if path.is_file() else None


def _token_content(value: Any, where: str) -> str | None:
    """A special token as stored: a string, an AddedToken dict (``{"content": ...}``) or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where} must be a string or an object with a 'content' string, got {value!r}")


def _named_special_tokens(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """``bos_token`` ... ``mask_token`` as strings, absent ones left out.

    As in transformers, ``special_tokens_map.json`` is a legacy file: read only when the config has no
    ``added_tokens_decoder``, and then its entries win over the config's.
    """
    raw = {name: config.get(name) for name in NAMED_SPECIAL_TOKENS}
    if "added_tokens_decoder" not in config:
        legacy = _read_optional_json(folder / SPECIAL_MAP_FILE) or {}
        raw.update({name: legacy[name] for name in NAMED_SPECIAL_TOKENS if name in legacy})
    out: dict[str, str] = {}
    for name, value in raw.items():
        content = _token_content(value, f"{folder / CONFIG_FILE}: {name}")
        if content is not None:
            out[name] = content
    return out


def _model_specific_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """Extra ``*_token`` strings (``image_token``, ...) that transformers also passes to templates."""
    out = {key: value for key, value in config.items()
           if key.endswith("_token") and key not in NAMED_SPECIAL_TOKENS and isinstance(value, str)}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        out.update({key: value for key, value in extra.items() if isinstance(value, str)})
    return out


def _apply_added_tokens(backend: Tokenizer, declared: Any, where: Path) -> None:
    """Make the backend's added tokens agree with ``added_tokens_decoder``.

    The config's flags win (transformers re-adds any entry whose flags differ, and re-adding updates the
    flags in place). An entry missing from ``tokenizer.json`` is appended, which must land on the id the
    config declares; any other disagreement means the two files come from different tokenizers.
    """
    if declared is None:
        return
    if not isinstance(declared, Mapping):
        raise TokenizerError(f"{where}: added_tokens_decoder must be an object of id -> token")
    existing = backend.get_added_tokens_decoder()
    entries: list[tuple[int, Mapping[str, Any]]] = []
    for key, entry in declared.items():
        if not str(key).isdigit() or not isinstance(entry, Mapping) or not isinstance(entry.get("content"), str):
            raise TokenizerError(f"{where}: added_tokens_decoder entry {key!r} must map an id to an object "
                                 f"with a 'content' string, got {entry!r}")
        entries.append((int(key), entry))
    for token_id, entry in sorted(entries, key=lambda e: e[0]):
        content = entry["content"]
        flags = {name: bool(entry[name]) for name in ADDED_TOKEN_FLAGS if name in entry}
        token = AddedToken(content, **flags)
        got = backend.token_to_id(content)
        if got is not None and got != token_id:
            raise TokenizerError(f"{where}: added token {content!r} has id {token_id} there but {got} in "
                                 f"{TOKENIZER_FILE}; the files belong to different tokenizers")
        current = existing.get(token_id)
        if current is not None and str(current) == content and all(
            getattr(current, name) == getattr(token, name) for name in ADDED_TOKEN_FLAGS
        ):
            continue
        backend.add_tokens([token])
        got = backend.token_to_id(content)
        if got != token_id:
            raise TokenizerError(f"{where}: added token {content!r} is declared with id {token_id} but is missing "
                                 f"from {TOKENIZER_FILE}, whose next free id is {got}")


def _eos_list(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
        raise TokenizerError(f"{where}: eos_token_id must be a non-negative int or a list of them, got {value!r}")
    return list(items)


def _generation_eos_ids(folder: Path) -> list[int]:
    """Stop ids from ``generation_config.json``, else ``config.json`` (top level or ``text_config``).

    transformers' ``generate`` takes the generation config's ids over the model config's, so an
    Instruct model's extra end-of-turn tokens (often only listed there) are honoured.
    """
    gen = _read_optional_json(folder / GENERATION_CONFIG_FILE)
    if gen is not None and gen.get("eos_token_id") is not None:
        return _eos_list(gen["eos_token_id"], str(folder / GENERATION_CONFIG_FILE))
    model = _read_optional_json(folder / MODEL_CONFIG_FILE) or {}
    value = model.get("eos_token_id")
    text_config = model.get("text_config")
    if value is None and isinstance(text_config, Mapping):
        value = text_config.get("eos_token_id")
    return _eos_list(value, str(folder / MODEL_CONFIG_FILE))


# ------------------------------------------------------------------------------------ chat template


def _chat_template_source(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The folder's default chat template, or None if it has none."""
    jinja_file = folder / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            text = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"cannot read {jinja_file}: {exc}") from None
        return text or None
    raw = config.get("chat_template")
    where = folder / CONFIG_FILE
    if raw is None or isinstance(raw, str):
        return raw or None
    if isinstance(raw, list):
        if not all(isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in raw):
            raise TokenizerError(f"{where}: chat_template must be a string or a list of {{name, template}} objects")
        raw = {t["name"]: t["template"] for t in raw}
    if not isinstance(raw, Mapping) or not all(isinstance(t, str) for t in raw.values()):
        raise TokenizerError(f"{where}: chat_template must be a string or a list of {{name, template}} objects")
    if "default" not in raw:
        raise TokenizerError(f"{where} has several chat templates ({', '.join(sorted(raw))}) and none named "
                             "'default'; rename the one to use to 'default'")
    return raw["default"] or None


def _compile_template(source: str, folder: Path) -> Any:
    """Compile once at load time, so a broken template fails before any model weights are read."""
    try:
        import jinja2
    except ImportError:
        raise TokenizerError(f"{folder} has a chat template, and rendering it needs jinja2: "
                             "pip install 'jinja2>=3.1.6'") from None
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_JINJA2:
        raise TokenizerError(f"{folder} has a chat template, which is code from the checkpoint, and jinja2 "
                             f"{jinja2.__version__} has known sandbox escapes; upgrade: pip install 'jinja2>=3.1.6'")
    env = _sandbox(jinja2)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        where = folder / CHAT_TEMPLATE_FILE if (folder / CHAT_TEMPLATE_FILE).is_file() else folder / CONFIG_FILE
        raise TokenizerError(f"{where}: the chat template does not parse (line {exc.lineno}): {exc.message}") from None


def _sandbox(jinja2: Any) -> Any:
    """A jinja2 environment with the settings and helpers chat templates are written against."""
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for loss masks in transformers;
        it renders its body unchanged, and templates that use it would not even parse without it."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set underscore attributes ({name!r})")

    class SafeNamespace(Namespace):
        """jinja2's ``namespace`` refusing underscore names, which could reach Python internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check_name(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            Namespace.__setitem__(self, name, value)

    class PlainDict:
        """``dict(...)`` for templates without handing them the ``dict`` type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja2's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=SafeNamespace,
                       dict=PlainDict())
    return env
