"""Shared fixtures. `tiny_target_dir` is a complete target folder (weights, config, tokenizer with chat
template) small enough that CLI, engine and demo tests never need the real embedded model."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from angelspec.models.decoder import TrainInputs

# The suite is CPU-first and its numbers are fp32's: on a GPU machine it still runs on the CPU (the library's default
# there is the GPU in bfloat16), and its torchrun launches use gloo, not NCCL. Set before anything is imported, so
# subprocesses (CLI runs, torchrun ranks) inherit both.
os.environ.setdefault("ANGELSPEC_DEVICE", "cpu")
os.environ.setdefault("ANGELSPEC_DIST_BACKEND", "gloo")

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


@pytest.fixture(scope="session", autouse=True)
def room_for_every_compiled_test() -> Iterator[None]:
    """The suite compiles engines over many distinct tiny models in one process, and each adds an entry to dynamo's
    per-function cache; past `recompile_limit` (8) dynamo runs that function eagerly from then on, without an error.
    A test that counts eager forwards failed that way when run after test_mtp, test_block_engine, test_eagle3 and
    test_spec_gate (it passed alone and in the suite's order; with these limits it passes in both, with the defaults
    it fails again); other compiled tests would silently run eager. A real
    process compiles a handful of engines, so the limit is raised for the test session only."""
    import torch._dynamo.config as dynamo_config

    saved = dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit
    dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit = 256, 4096
    yield
    dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit = saved


# ----- helpers shared by the drafter test files (tiny targets, engine checks, trainer data and outputs) -----

DOMAIN_PROMPTS = [("code", "def add(x, y):"), ("math", "What is 7 + 8?"), ("chat", "Hello there.")]
QUIET = dict(progress=False, log=lambda *_: None)  # keyword arguments that silence a trainer or tool


def tiny_decoder(vocab: int = 64, layers: int = 2, heads: int = 4, kv: int = 2, seed: int = 0, std: float = 0.3,
                 dtype: Any = None) -> Any:
    """A random eval-mode decoder (hidden 32, head_dim 8, EOS 3) in `dtype` (default float64), weights drawn
    after `torch.manual_seed(seed)` with `std` large enough that random drafters still get drafts accepted."""
    import torch

    from angelspec.models import Decoder, DecoderConfig

    cfg = DecoderConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv, head_dim=8, max_position_embeddings=256,
                        eos_token_id=3)
    torch.manual_seed(seed)
    model = Decoder(cfg)
    model.init_weights(std=std)
    return model.to(torch.float64 if dtype is None else dtype).eval()


def random_requests(vocab: int, n: int, new: int, seed: int) -> list:
    """n greedy requests of 1..12 random prompt tokens and `new` new tokens each, without stop tokens."""
    from angelspec.decoding.engine import Request

    rng = random.Random(seed)
    return [Request([rng.randrange(vocab) for _ in range(rng.randint(1, 12))], max_new_tokens=new, stop_ids=())
            for _ in range(n)]


def generate_twice_without_recompiles(engine: Any, first: list, second: list,
                                     between: Any = None) -> list:
    """`first` through a compiled engine, then (after `between()`, when given) `second` under `fail_on_recompile`;
    try_compile's fallback to eager (a UserWarning) fails either run. Both runs' results, in order."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # try_compile warns when it falls back to eager
        out = engine.generate(first)
        if between is not None:
            between()
        with torch.compiler.set_stance("fail_on_recompile"):
            out += engine.generate(second)
    return out


def assert_admissions_compile_nothing_mid_run(target: Any, drafter: Any, vocab: int) -> None:
    """A compiled engine with 4 rows serves 4 requests admitted at once, then 8 more admitted one or two at a time as
    rows free up (new admission counts, new longest prompts) without compiling anything
    (`generate_twice_without_recompiles`); every output equals AR's."""
    from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, reference_generate

    rng = random.Random(11)
    reqs = [Request([rng.randrange(vocab) for _ in range(rng.randint(2, 12))], max_new_tokens=rng.randint(6, 24),
                    stop_ids=()) for _ in range(12)]
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=4, num_draft_tokens=3, compile=True))
    got = generate_twice_without_recompiles(engine, reqs[:4], reqs[4:])
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]


def assert_two_calls_draft_as_joined(target, make_recording, reqs, k: int = 3) -> None:
    """A batch-1 engine whose drafter runs a round's catch-up and drafting as two calls (`join_catch_up = False`,
    the other side of `benchmarks/joined_calls.py`) proposes exactly what the joined call proposes and stays
    lossless; `make_recording()` builds a fresh recording drafter (`RecordingMixin`) on the same model."""
    from angelspec.decoding.engine import EngineConfig, SpecEngine, reference_generate

    config = EngineConfig(max_batch_size=1, num_draft_tokens=k)
    joined = make_recording()
    SpecEngine(target, joined, config).generate(reqs)
    split = make_recording()
    split.join_catch_up = False
    got = SpecEngine(target, split, config).generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    assert split.proposals == joined.proposals and len(joined.proposals) > 10


class RecordingMixin:
    """Mixed in before a drafter class: remembers each row's committed sequence and every greedy proposal made
    from it (`proposals`: (committed sequence, drafts)), to recompute each proposal from scratch. Call
    `start_recording()` when the drafter is set up."""

    def start_recording(self) -> None:
        self.history: dict[int, list[int]] = {}
        self.proposals: list[tuple[list[int], list[int]]] = []

    def prefill(self, rows, prompts, first_tokens, target_hidden):
        super().prefill(rows, prompts, first_tokens, target_hidden)
        for r, p, f in zip(rows, prompts, first_tokens, strict=True):
            self.history[r] = [*p, f]

    def propose(self, state):
        prop = super().propose(state)
        for r in state.active_rows:
            self.proposals.append((list(self.history[r]), prop.tokens[r].tolist()))
        return prop

    def on_commit(self, commit):
        super().on_commit(commit)
        for r, toks in enumerate(commit.host_tokens):
            self.history.setdefault(r, []).extend(toks)


def check_lossless_and_recorded(target: Any, drafter: RecordingMixin, requests: list, config: Any, every: int,
                                recompute: Any) -> list:
    """Greedy speculative decoding of `requests` with a recording drafter equals plain autoregressive decoding,
    some drafts were accepted (so partial accepts and the cache rollback ran), and every `every`-th proposal
    equals `recompute(committed sequence)`, the from-scratch drafts; returns the outputs."""
    from angelspec.decoding.engine import SpecEngine, reference_generate

    engine = SpecEngine(target, drafter, config)
    got = engine.generate(requests)
    want = reference_generate(target, requests)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert sum(engine.metrics.accept_hist[1:]) > 0
    for seq, drafts in drafter.proposals[::every]:
        assert recompute(seq) == drafts
    return got


def mtp_reference_drafts(block: Any, target: Any, sequence: list[int], k: int) -> list[int]:
    """Slow oracle for an MTP-family drafter's greedy `propose`: recompute from scratch, through the TRAINING
    rollout, the K argmax drafts after the committed `sequence` (target forward over it, then `ttt_rollout`
    read at position s-2)."""
    import torch

    from angelspec.models.mtp import concat_taps
    from angelspec.train.ttt import ttt_rollout

    with torch.no_grad():
        ids = torch.tensor([list(sequence)], device=target.embed_tokens.weight.device)  # [1, s]
        s = ids.shape[1]
        hidden = target(ids, TrainInputs(hidden_layers=list(block.config.target_layer_ids),
                                         compute_logits=False)).hidden
        pos = torch.arange(s, device=ids.device)[None]
        out = ttt_rollout(block, concat_taps(hidden), ids, pos, None, k)  # taps [1, s, n·C]
    return out.logits[0, s - 2].argmax(dim=-1).tolist()


def write_conversations(path: Path, n: int, seed: int) -> Path:
    """`n` synthetic lines as n // 2 user / assistant conversations, one JSON line each."""
    lines = list(synthetic_sentences(n, seed=seed))
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in zip(lines[::2], lines[1::2], strict=True)))
    return path


def write_domain_prompts(path: Path) -> Path:
    """One evaluation prompt per domain (code, math, chat)."""
    path.write_text("".join(json.dumps({"prompt": p, "domain": d}) + "\n" for d, p in DOMAIN_PROMPTS))
    return path


def train_log(out_dir: Path) -> list[dict]:
    """A trainer's JSONL log lines under `out_dir`."""
    return [json.loads(x) for x in (out_dir / "training" / "train_log.jsonl").read_text().splitlines()]


def same_weights(a: Path, b: Path) -> dict:
    """Assert that the drafter folders `a` and `b` hold bit-identical `model.safetensors`; returns a's tensors."""
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return wa


def record_proposals(drafter: Any) -> list:
    """Wrap `drafter.propose` (instance attribute) so every Proposal it returns is appended to the returned list."""
    seen: list = []
    propose = drafter.propose

    def spy(state: Any) -> Any:
        proposal = propose(state)
        seen.append(proposal)
        return proposal

    drafter.propose = spy
    return seen


def run_cli(capsys: Any, *args: object) -> tuple[int, str, str]:
    """`angelspec.cli.main(args)`: (exit code, stdout, stderr)."""
    from angelspec.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_bad_input(code: int, err: str, *needles: str) -> None:
    """Exit 2 with exactly one `angelspec: error:` line that contains every needle (and no traceback)."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("angelspec: error: "), err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
