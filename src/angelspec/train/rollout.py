"""Target-model rollout (report §2.4): regenerate a dataset's assistant turns with the frozen target.

Why: a drafter is scored on how well it predicts the *deployed target*, so training on the target's own
responses (its token choices and uncertainty) beats training on human or other-model references. The
prompts are rendered with the target's chat template in the serving mode (think / no-think) and decoded
in batches through :class:`~angelspec.decoding.engine.SpecEngine`, or through vLLM's offline batch API with
``engine="vllm"`` (:class:`~angelspec.decoding.vllm_engine.VllmEngine`: the same JSONL, bit-identical at T=0 on the
embedded target, for targets served by vLLM workers; vLLM lives in its own venv, `make vllm-venv`). `angelspec
rollout` (angelspec.cli.data) is the command line of :func:`rollout`.

Input lines (the prompts format of :mod:`angelspec.data.prompts`): ``{"prompt": str}`` or
``{"messages": [...]}``. Every assistant turn is replaced by the target's response, turn by turn: the
prefix up to the first assistant turn is generated from, the response appended, the next user turn
appended, and so on; a conversation that ends with a user turn gets one more response. Output lines::

    {"messages": [...], <the input line's other keys>, "rollout": {"finish_reason": "stop" | "length",
     "num_tokens": int, "turns": [{"finish_reason", "num_tokens"}, ...], "dropped_turns": int}}

``finish_reason`` is "length" when any turn hit ``max_new_tokens`` (or the context end): such responses are
kept, flagged and counted. A first prompt longer than the context is skipped (counted); a later turn
that no longer fits ends the conversation there (``dropped_turns``).

Resuming
--------
Lines are processed in fixed chunks. After each chunk the output is appended and fsynced, then a sidecar
``OUT.progress.json`` is replaced atomically with ``{lines_done, bytes, counters, config}``. A kill at any
moment leaves the sidecar describing a prefix of complete chunks; ``resume=True`` truncates the output
to the recorded byte count (dropping a partially written chunk or line) and continues at ``lines_done``.
Request seeds derive from (seed, line index, turn), and the engine draws the same tokens for a request
in any batch, so a resumed file is byte-identical to an uninterrupted one. The sidecar's ``config`` (the
target's weights id, :func:`~angelspec.decoding.loading.target_weights_id`, and its dtype, prompts hash, sampling
settings, and the engine when it is vLLM) must match, or resuming is refused. With vLLM the target is not loaded
in this process, so its fingerprint is the folder's (:func:`~angelspec.data.fingerprint.checkpoint_fingerprint`);
at T>0 vLLM draws other samples than our engine, so
a file is continued only by the engine that started it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from angelspec.assets import resolve_target_dir
from angelspec.data.chat import SPECIAL_TOKENS
from angelspec.data.fingerprint import checkpoint_fingerprint, file_sha256, model_fingerprint
from angelspec.data.prompts import load_prompts
from angelspec.fileio import check_writable_path, refuse_same_file, write_json_atomic

if TYPE_CHECKING:
    from angelspec.decoding.vllm_engine import VllmSettings
    from angelspec.models.device import Placement

PROGRESS_SUFFIX = ".progress.json"
_TARGET_KEYS = ("target_weights", "target_dtype")  # the target's identity in a sidecar's config (our engine)
SIDECAR_VERSION = 1
LINES_PER_CHUNK_PER_ROW = 8  # chunk = 8 x batch size: enough requests to keep the engine's rows busy
ENGINES = ("ours", "vllm")  # our SpecEngine; vLLM's offline batch API (optional, its own venv)
BATCH_SIZE = {"ours": 8, "vllm": 256}  # default concurrent requests per engine (vLLM's max_num_seqs)


class RolloutError(ValueError):
    """A rollout that cannot run or resume; the message names the file, line or setting to fix."""


@dataclass
class RolloutSummary:
    """Counts over the whole output file (a resumed run includes the lines written before the kill)."""

    lines: int = 0  # input lines
    written: int = 0  # conversations in the output
    skipped_too_long: int = 0  # first prompt does not fit the context
    turns: int = 0  # responses generated
    truncated_turns: int = 0  # responses that hit max_new_tokens or the context end (kept, flagged)
    truncated_lines: int = 0  # conversations with at least one such response
    dropped_turns: int = 0  # later turns cut because the conversation outgrew the context
    tokens: int = 0  # generated tokens
    resumed_at: int = 0  # input line the run started at (0 = fresh)
    wall_s: float = 0.0  # this run only

    def format(self) -> str:
        return (f"rollout: {self.written}/{self.lines} conversations, {self.turns} responses, {self.tokens} tokens "
                f"in {self.wall_s:.1f} s | hit max_new_tokens: {self.truncated_turns} responses in "
                f"{self.truncated_lines} conversations (kept, rollout.finish_reason='length') | skipped "
                f"(prompt longer than context): {self.skipped_too_long} | turns dropped at context end: "
                f"{self.dropped_turns}" + (f" | resumed at line {self.resumed_at}" if self.resumed_at else ""))


_COUNTERS = ("written", "skipped_too_long", "turns", "truncated_turns", "truncated_lines", "dropped_turns", "tokens")


@dataclass
class _Conversation:
    """One input line in flight: the input messages, the output built so far, and a cursor into the input."""

    index: int  # 0-based index among the file's prompts (seeds key on it)
    line: int  # 1-based line number, for messages
    source: list[dict[str, Any]]
    extras: dict[str, Any]
    out: list[dict[str, Any]] = field(default_factory=list)
    cursor: int = 0
    turns: list[dict[str, Any]] = field(default_factory=list)
    dropped_turns: int = 0
    skipped: bool = False
    done: bool = False

    def advance(self) -> bool:
        """Copy input messages up to the next assistant turn; True if a response must be generated now."""
        while self.cursor < len(self.source) and self.source[self.cursor]["role"] != "assistant":
            self.out.append(self.source[self.cursor])
            self.cursor += 1
        if self.out and self.out[-1]["role"] == "user":
            return True
        self.done = True
        return False

    def remaining_turns(self) -> int:
        rest = self.source[self.cursor:]
        return sum(m["role"] == "assistant" for m in rest) + int(bool(rest) and rest[-1]["role"] == "user")


def check_turn_structure(messages: Sequence[dict[str, Any]], where: str) -> None:
    """Every assistant turn must answer a user turn, and a conversation may end only with an assistant
    or a user turn: otherwise there is no well-defined prompt to regenerate a response from."""
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and (i == 0 or messages[i - 1]["role"] != "user"):
            prev = "nothing" if i == 0 else f"a {messages[i - 1]['role']} turn"
            raise RolloutError(f"{where}: messages[{i}] is an assistant turn after {prev}; each assistant turn must "
                               "follow a user turn")
    if messages[-1]["role"] == "system":
        raise RolloutError(f"{where}: the conversation ends with a system message; nothing to respond to")


def split_response(token_ids: Sequence[int], finish_reason: str, tokenizer: Any, stop_ids: Sequence[int],
                   enable_thinking: bool) -> dict[str, Any]:
    """Turn generated ids into an assistant message that re-renders under the chat template.

    The stop token is dropped (the template adds ``<|im_end|>`` itself). In thinking mode the target
    writes ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``; the ids are split at ``</think>`` so the
    reasoning lands in ``reasoning_content``. Special tokens inside the text are skipped when decoding, and any
    control-token string left in the text (``<think>`` written mid-answer, which the tokenizer decodes as text, or
    one spelled out of ordinary pieces) is removed: a message content may not carry control tokens (they would forge
    turn boundaries, and training refuses such a conversation).
    """
    ids = list(token_ids)
    if finish_reason == "stop" and ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    message: dict[str, Any] = {"role": "assistant"}
    think_start = tokenizer.token_to_id("<think>")
    think_end = tokenizer.token_to_id("</think>")
    if enable_thinking and think_start is not None and ids and ids[0] == think_start:
        if think_end in ids:
            cut = ids.index(think_end)
            reasoning = _text(tokenizer, ids[1:cut])
            content = _text(tokenizer, ids[cut + 1:]).removeprefix("\n\n")
        else:  # ran out of tokens while thinking
            reasoning, content = _text(tokenizer, ids[1:]), ""
        message["content"] = content
        message["reasoning_content"] = reasoning.removeprefix("\n").removesuffix("\n")
    else:
        message["content"] = _text(tokenizer, ids)
    return message


def _text(tokenizer: Any, ids: Sequence[int]) -> str:
    """`ids` decoded without special tokens and without any control-token string (`split_response`)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "")
    return text


def _progress_path(out: Path) -> Path:
    return out.with_name(out.name + PROGRESS_SUFFIX)


def _write_progress(path: Path, state: dict[str, Any]) -> None:
    write_json_atomic(path, state)


def _append_chunk(out: Path, lines: list[str]) -> int:
    """Append complete lines and fsync them before the sidecar may count them; returns the new size."""
    with open(out, "ab") as f:
        f.write("".join(lines).encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def _prepare_output(out: Path, config: dict[str, Any], *, resume: bool, force: bool,
                    legacy_target: Callable[[], str] | None = None) -> dict[str, Any]:
    """Validate the output path and return the progress state to start from (fresh or resumed). `legacy_target`:
    the target's id as sidecars recorded it before the weights id (`"target"`, the fingerprint at the load dtype),
    for resuming such a sidecar: it is compared instead of `"target_weights"` and `"target_dtype"`."""
    progress = _progress_path(out)
    if out.is_dir():
        raise RolloutError(f"--out {out} is a directory; give a file name such as {out / 'rollout.jsonl'}")
    fresh = {"version": SIDECAR_VERSION, "config": config, "lines_done": 0, "bytes": 0, "complete": False,
             "counters": dict.fromkeys(_COUNTERS, 0)}
    if force and not resume:
        out.unlink(missing_ok=True)
        progress.unlink(missing_ok=True)
    if resume and progress.is_file():
        try:
            state = json.loads(progress.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RolloutError(f"cannot resume: {progress} is unreadable ({e}); start over with --force") from None
        if state.get("version") != SIDECAR_VERSION or not isinstance(state.get("config"), dict):
            raise RolloutError(f"cannot resume: {progress} was written by another rollout format; use --force")
        if legacy_target is not None and "target" in state["config"] and "target_weights" not in state["config"]:
            config = {**{k: v for k, v in config.items() if k not in _TARGET_KEYS}, "target": legacy_target()}
        changed = sorted(k for k in config.keys() | state["config"].keys() if config.get(k) != state["config"].get(k))
        if changed:
            detail = ", ".join(f"{k}: {state['config'].get(k)!r} -> {config.get(k)!r}" for k in changed)
            raise RolloutError(f"cannot resume {out}: the settings differ from the interrupted run ({detail}); rerun "
                               "with the original settings, or start over with --force")
        size = out.stat().st_size if out.is_file() else -1
        if size < state["bytes"]:
            raise RolloutError(f"cannot resume: {out} has {max(size, 0)} bytes but {progress} records {state['bytes']} "
                               "written; the output was modified or lost, start over with --force")
        if size > state["bytes"]:
            # A chunk was being written when the run stopped; its lines are regenerated identically.
            os.truncate(out, state["bytes"])
        return state
    if resume and out.exists():
        raise RolloutError(f"cannot resume {out}: no progress file {progress} beside it (was it written by "
                           "`angelspec rollout`?); start over with --force")
    if out.exists() or progress.exists():
        raise FileExistsError(f"--out {out} already exists; pass --resume to continue it or --force to overwrite it")
    return fresh


@dataclass(frozen=True)
class RolloutSettings:
    """How `rollout` generates, one value the command line builds from its flags: `enable_thinking` renders the
    prompts with the chat template's thinking on; `temperature` / `top_p` / `top_k` sample (temperature 0: greedy),
    per-request seeds derived from `seed` (so a resume reproduces); `max_new_tokens` per assistant turn;
    `batch_size` concurrent requests (None: 8 for ours, 256 for vLLM, its `max_num_seqs`); `chunk_lines` input lines
    decoded and committed at a time (None: 8 x batch_size; smaller chunks lose less work to a kill, larger ones keep
    more requests in flight between turns); `engine` "ours" (`SpecEngine`) or "vllm" (vLLM's `LLM.generate`)."""

    enable_thinking: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 512
    batch_size: int | None = None
    chunk_lines: int | None = None
    engine: str = "ours"


def rollout(target_dir: str | Path | None, prompts_path: str | Path, out_path: str | Path,
            settings: RolloutSettings | None = None, *, resume: bool = False, force: bool = False,
            progress: bool = False, placement: Placement | None = None,
            vllm: VllmSettings | None = None) -> RolloutSummary:
    """Regenerate every assistant turn of ``prompts_path`` with the target in ``target_dir`` (None: the
    embedded target), as ``settings`` say (`RolloutSettings`; None: the defaults).

    Engine "vllm" without vLLM installed fails at once with one line saying how to install it. ``vllm``: dtype,
    tensor parallelism, memory share and context of the vLLM engine (`VllmSettings`; only with engine "vllm").
    ``placement``: the device and dtype our engine runs the target in (None: the default of
    `angelspec.models.device.resolve_placement`; a resumed file must match the target's weights and this dtype).
    Returns the :class:`RolloutSummary` of the whole file.
    """
    from angelspec.data.tokenizer import load_tokenizer
    from angelspec.decoding.sampling import SamplingParams

    t0 = time.perf_counter()
    s = RolloutSettings() if settings is None else settings
    engine, batch_size, seed, max_new_tokens = s.engine, s.batch_size, s.seed, s.max_new_tokens
    if engine not in ENGINES:
        raise RolloutError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if vllm is not None and engine != "vllm":
        raise RolloutError("vLLM settings (--vllm-dtype, --tensor-parallel-size, --gpu-memory-utilization, "
                           "--max-model-len) apply to --engine vllm only")
    batch_size = BATCH_SIZE[engine] if batch_size is None else batch_size
    if engine == "vllm":
        from angelspec.decoding.vllm_engine import import_vllm

        import_vllm("--engine vllm")  # before any file is read or written
    target_dir = resolve_target_dir(target_dir)
    for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RolloutError(f"{name} must be an int >= 1, got {value!r}")
    chunk = s.chunk_lines or LINES_PER_CHUNK_PER_ROW * batch_size
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise RolloutError(f"seed must be an int (per-line seeds derive from it, so a resume reproduces), got {seed!r}")
    try:
        SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed)
    except ValueError as e:
        raise RolloutError(f"invalid sampling settings: {e}") from None
    out = Path(out_path)
    refuse_same_file(out, ("--prompts", prompts_path))
    refuse_same_file(_progress_path(out), ("--prompts", prompts_path), flag="the progress file of --out,")
    if out.exists() and not (resume or force):  # fail before loading a large target; full checks below
        raise FileExistsError(f"--out {out} already exists; pass --resume to continue it or --force to overwrite it")
    check_writable_path(out)
    prompts = load_prompts(prompts_path)  # validates every line before the model is loaded
    conversations = []
    for i, p in enumerate(prompts):
        check_turn_structure(p["messages"], f"{prompts_path}:{p['line']}")
        extras = {k: v for k, v in p["record"].items() if k not in ("prompt", "messages", "rollout")}
        conversations.append(_Conversation(index=i, line=p["line"], source=p["messages"], extras=extras))

    from angelspec.decoding.limits import check_counts, check_fits_target
    from angelspec.models import read_config

    check_counts(max_new_tokens=max_new_tokens, batch_size=batch_size)
    if engine == "ours":  # vLLM holds its cache in the memory share it is given (--gpu-memory-utilization)
        from angelspec.models.device import placement_of

        where = placement_of(placement)
        check_fits_target(read_config(target_dir), rows=min(batch_size, max(len(conversations), 1)),
                          dtype_bytes=where.dtype.itemsize, device=where.device, with_weights=True)
    tokenizer = load_tokenizer(target_dir)
    generator, target_id, legacy_target, context = _start_engine(engine, target_dir, batch_size, placement, vllm)
    try:
        stop_ids = tuple(tokenizer.eos_token_ids)
        config = {**target_id, "prompts": file_sha256(prompts_path), "enable_thinking": s.enable_thinking,
                  "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": seed,
                  "max_new_tokens": max_new_tokens}
        if engine != "ours":  # absent for our engine, so sidecars written before engines existed still resume
            config["engine"] = engine
        state = _prepare_output(out, config, resume=resume, force=force, legacy_target=legacy_target)
        summary = _run_chunks(conversations, state, out, generator, tokenizer, s, context=context, chunk=chunk,
                              stop_ids=stop_ids, progress=progress)
    finally:
        close = getattr(generator, "close", None)
        if close is not None:
            close()
    summary.wall_s = time.perf_counter() - t0
    return summary


def _start_engine(engine: str, target_dir: Path, batch_size: int, placement: Placement | None = None,
                  vllm: VllmSettings | None = None) -> tuple[Any, dict[str, str], Callable[[], str] | None, int]:
    """(the engine with a `generate(requests, progress=...)`, the target's identity as the sidecar records it, the
    id older sidecars recorded (`_prepare_output`'s `legacy_target`), its context length). Our engine: the weights id
    every command shares (`target_weights_id`) and the dtype it runs in (which changes the tokens); vLLM, whose
    target is not loaded here: the folder's `checkpoint_fingerprint`."""
    if engine == "vllm":
        from angelspec.decoding.vllm_engine import VllmEngine

        generator = VllmEngine(target_dir, max_batch_size=batch_size, settings=vllm)
        return generator, {"target": checkpoint_fingerprint(target_dir)}, None, generator.context
    from angelspec.decoding.engine import EngineConfig, SpecEngine
    from angelspec.decoding.loading import target_weights_id
    from angelspec.models import load_target
    from angelspec.models.device import placement_of

    where = placement_of(placement)
    where.use_attention()
    target = load_target(target_dir, dtype=where.dtype, device=where.device)
    generator = SpecEngine(target, config=EngineConfig(max_batch_size=batch_size))
    identity = {"target_weights": target_weights_id(target_dir, target),
                "target_dtype": str(where.dtype).removeprefix("torch.")}
    return generator, identity, lambda: model_fingerprint(target), target.config.max_position_embeddings


def _run_chunks(conversations: list[_Conversation], state: dict[str, Any], out: Path, engine: Any, tokenizer: Any,
                settings: RolloutSettings, *, context: int, chunk: int, stop_ids: tuple[int, ...],
                progress: bool) -> RolloutSummary:
    """Generate and append the chunks from `state["lines_done"]` on, as `settings` say (its batch size and chunk
    length resolved to `chunk`); the summary of the whole file."""
    from angelspec.decoding.engine import Request
    from angelspec.decoding.sampling import SamplingParams

    temperature, top_k, top_p, seed = settings.temperature, settings.top_k, settings.top_p, settings.seed
    max_new_tokens, enable_thinking = settings.max_new_tokens, settings.enable_thinking
    out.parent.mkdir(parents=True, exist_ok=True)
    progress_file = _progress_path(out)
    summary = RolloutSummary(lines=len(conversations), resumed_at=state["lines_done"])

    start = state["lines_done"]
    if start == 0 and not out.exists():
        out.touch()
        _write_progress(progress_file, state)
    for lo in range(start, len(conversations), chunk):
        group = conversations[lo:lo + chunk]
        for turn in range(max((c.remaining_turns() for c in group), default=0) + 1):
            requests, owners = [], []
            for c in group:
                if c.done or not c.advance():
                    continue
                ids = tokenizer.apply_chat_template(c.out, add_generation_prompt=True, enable_thinking=enable_thinking)
                if len(ids) >= context:
                    if turn == 0:
                        c.skipped = True  # the whole line: not even its first prompt fits
                    else:
                        c.out.pop()  # the user turn that has no room for an answer, and all after it
                        c.dropped_turns = c.remaining_turns() if c.cursor < len(c.source) else 1
                    c.done = True
                    continue
                params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                        seed=_request_seed(seed, c.index, turn))
                requests.append(Request(prompt_ids=ids, max_new_tokens=min(max_new_tokens, context - len(ids)),
                                        sampling=params, stop_ids=stop_ids, request_id=len(owners)))
                owners.append(c)
            if not requests:
                break
            for c, res in zip(owners, engine.generate(requests, progress=progress), strict=True):
                c.out.append(split_response(res.token_ids, res.finish_reason, tokenizer, stop_ids, enable_thinking))
                c.turns.append({"finish_reason": res.finish_reason, "num_tokens": len(res.token_ids)})
                c.cursor += 1 if c.cursor < len(c.source) else 0  # skip the input's assistant turn, if any
        lines = [_record_line(c, state["counters"]) for c in group]
        state["bytes"] = _append_chunk(out, [ln for ln in lines if ln is not None])
        state["lines_done"] = lo + len(group)
        state["complete"] = state["lines_done"] == len(conversations)
        _write_progress(progress_file, state)
    if not state["complete"]:  # resumed a finished run, or an empty tail
        state["complete"] = state["lines_done"] >= len(conversations)
        _write_progress(progress_file, state)
    for k in _COUNTERS:
        setattr(summary, k, state["counters"][k])
    return summary


def _request_seed(seed: int, index: int, turn: int) -> int:
    """Distinct per (line, turn), independent of chunking and batching: the key of resume == fresh."""
    return seed * 1_000_003 + (index << 12) + turn


def _record_line(c: _Conversation, counters: dict[str, int]) -> str | None:
    """The output line of one conversation (None when skipped); updates the running counters."""
    counters["dropped_turns"] += c.dropped_turns
    if c.skipped or not c.turns:
        counters["skipped_too_long"] += 1
        return None
    truncated = [t for t in c.turns if t["finish_reason"] == "length"]
    counters["written"] += 1
    counters["turns"] += len(c.turns)
    counters["truncated_turns"] += len(truncated)
    counters["truncated_lines"] += int(bool(truncated))
    counters["tokens"] += sum(t["num_tokens"] for t in c.turns)
    info = {"finish_reason": "length" if truncated else "stop", "num_tokens": sum(t["num_tokens"] for t in c.turns),
            "turns": c.turns, "dropped_turns": c.dropped_turns}
    record = {"messages": c.out, **c.extras, "rollout": info}
    return json.dumps(record, ensure_ascii=False) + "\n"
