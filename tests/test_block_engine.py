"""Block-parallel drafters in the engine and the trainer (report §3; DSpark report §3): greedy speculative output
equals autoregressive output for DFlash / DFly / DSpark with every proposal equal to a from-scratch recompute
(so the context cache is exact after partial accepts), the T=1 output distribution of DSpark / DFly sampled drafts
(chi-square, with negative controls), training + exact resume, the real-target
presets on a tiny target, train + eval from the command line, and bad input.

Engine tests run in float64 on a tiny target so batched and single-row arithmetic agree far below any argmax gap."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import conftest
import pytest
import torch
from conftest import (
    QUIET,
    RecordingMixin,
    assert_admissions_compile_nothing_mid_run,
    assert_two_calls_draft_as_joined,
    check_lossless_and_recorded,
    random_requests,
    tiny_decoder,
)
from test_distributed import _torchrun, needs_gloo
from test_engine_spec import (  # noqa: F401  (dist_case is a fixture)
    WRONG_SAMPLERS,
    assert_t1_matches_target,
    assert_wrong_sampler_detected,
    dist_case,
)

from angelspec.decoding.drafters import get_drafter
from angelspec.decoding.drafters.base import DrafterMismatchError
from angelspec.decoding.drafters.block import (
    BlockDrafterAdapter,
    DFlashDrafter,
    DFlyDrafter,
    DSparkDrafter,
    reference_drafts,
)
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, reference_generate
from angelspec.models import CheckpointError, ConfigError, Decoder, load_target
from angelspec.models.block.config import BlockDrafterConfig
from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.block.io import save_block_drafter
from angelspec.train.block import (
    BlockDrafterTrainConfig,
    dspark_shipped,
    dspark_shipped_af,
    qwen3_8b_dfly,
    qwen3_8b_dspark,
    resolve_mask_token,
    tiny_debug,
    train_block_drafter,
    train_dfly,
)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, MASK = 16, 1
DESIGNS = {"dflash": ("dflash", "none"), "dfly": ("dfly", "hidden"), "dspark": ("dflash", "markov")}
FUSED = "+anchor_fusion"  # a kind with this suffix: the drafter with the fused anchor input


def tiny_target(layers: int = 3, vocab: int = VOCAB) -> Decoder:
    return tiny_decoder(vocab, layers=layers, heads=2, kv=1)


def tiny_block_drafter(target: Decoder, kind: str, block_size: int = 4, layer_ids: tuple[int, ...] = (0, 2)
                       ) -> BlockDrafter:
    conditioning, head = DESIGNS[kind.removesuffix(FUSED)]
    cfg = BlockDrafterConfig.for_target(target.config, mask_token_id=MASK, block_size=block_size,
                                        num_draft_layers=1, target_layer_ids=layer_ids, conditioning=conditioning,
                                        head=head, markov_rank=8, anchor_fusion=kind.endswith(FUSED))
    model = BlockDrafter(cfg, target.embed_tokens, target.lm_head)
    model.init_weights(std=0.3, generator=torch.Generator().manual_seed(1))
    for p in model.parameters():  # W2 / the SwiGLU down projection start at zero: make every head matter
        if p.dim() == 2 and not p.abs().sum():
            torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(2))
    return model.double()


class RecordingDrafter(RecordingMixin, BlockDrafterAdapter):
    """Records (committed sequence, proposed drafts) per active row, to recompute each proposal from scratch."""

    def __init__(self, model: BlockDrafter) -> None:
        super().__init__(model)
        self.start_recording()


# ---------------------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "k"), [("dflash", 3), ("dfly", 3), ("dspark", 3), ("dfly", 2),
                                         ("dfly" + FUSED, 3), ("dspark" + FUSED, 2)])
def test_greedy_spec_decoding_is_lossless_and_drafts_match_a_fresh_recompute(kind, k):
    target = tiny_target()
    drafter = RecordingDrafter(tiny_block_drafter(target, kind))
    assert drafter.kind == kind.removesuffix(FUSED)
    rng = random.Random(len(kind) + k)
    reqs = [Request([rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))], max_new_tokens=48, stop_ids=())
            for _ in range(10)]
    # Partial accepts happen, so the cache append path runs; the context cache is exact iff every proposal equals
    # the from-scratch recompute on the committed prefix.
    got = check_lossless_and_recorded(target, drafter, reqs, EngineConfig(max_batch_size=4, num_draft_tokens=k), 7,
                                      lambda seq: reference_drafts(drafter.model, target, seq, k))
    assert all(len(r.token_ids) == 48 for r in got)


def test_sampling_smoke_t1_returns_probs_and_confidences():
    from angelspec.decoding.sampling import SamplingParams

    target = tiny_target()
    drafter = DSparkDrafter(tiny_block_drafter(target, "dspark"))
    seen = conftest.record_proposals(drafter)
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=3, num_draft_tokens=3))
    reqs = [Request([5, 6, 7][: i + 1], max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=i),
                    stop_ids=()) for i in range(3)]
    out = engine.generate(reqs)
    assert [len(r.token_ids) for r in out] == [16, 16, 16]
    prop = seen[0]
    assert not prop.deterministic and prop.probs is not None and prop.probs.shape == (3, 3, VOCAB)
    assert prop.confidences is not None and ((prop.confidences > 0) & (prop.confidences < 1)).all()


def sampling_block_drafter(target: Decoder, kind: str) -> BlockDrafterAdapter:
    """A DSpark (Markov head) or DFly (hidden-correction head) drafter for the T=1 distribution tests, on the
    two-layer target of `dist_case`. DSpark's Markov bias is scaled up so that draft 2's q depends clearly on the
    sampled draft 1 (max TV between its q for two values of draft 1: 0.1 unscaled, about 0.7 here); DFly's head
    already moves it that much."""
    model = tiny_block_drafter(target, kind, layer_ids=(0, 1))
    if kind == "dspark":
        with torch.no_grad():
            model.head.out.weight.mul_(5.0)
    return BlockDrafterAdapter(model)


@pytest.mark.parametrize("kind", ["dspark", "dfly"])
def test_t1_sampled_drafts_keep_the_target_distribution(dist_case, kind):  # noqa: F811
    """Standard speculative sampling with a block drafter's sampled drafts (T=1) emits the target's distribution:
    chi-square on the first three tokens of 4000 seeded requests against the target's exact softmax (alpha 1e-4).
    The sequential head conditions each draft on the previously SAMPLED one, so the q returned per position must be
    the distribution that draft was really drawn from."""
    tgt, _, joint = dist_case
    assert_t1_matches_target(tgt, sampling_block_drafter(tgt, kind), joint, kind)


@pytest.mark.parametrize("wrong", WRONG_SAMPLERS)
def test_t1_distribution_test_detects_a_wrong_sampler(dist_case, monkeypatch, wrong):  # noqa: F811
    """Negative control for the test above (DSpark): the same drafter and statistics with the min(1, p/q) test
    removed, or with draft 2's q replaced by draft 1's (the Markov conditioning lost), must fail."""
    tgt, _, joint = dist_case
    assert_wrong_sampler_detected(tgt, sampling_block_drafter(tgt, "dspark"), joint, wrong, monkeypatch)


def test_registry_folder_round_trip_and_mismatches(tmp_path):
    target = tiny_target()
    assert {get_drafter(k) for k in ("dflash", "dfly", "dspark")} == {DFlashDrafter, DFlyDrafter, DSparkDrafter}
    save_block_drafter(tiny_block_drafter(target, "dfly"), tmp_path / "d")
    drafter = DFlyDrafter.from_pretrained(tmp_path / "d", target=target)
    assert drafter.target_layer_ids == (0, 2) and drafter.max_draft_tokens == 3
    drafter.check_compatible(target.config, num_draft_tokens=3)
    with pytest.raises(DrafterMismatchError, match="at most 3 drafts"):  # K > B − 1
        drafter.check_compatible(target.config, num_draft_tokens=4)
    with pytest.raises(DrafterMismatchError, match="at most 3 drafts"):  # also refused when the engine asks
        SpecEngine(target, drafter, EngineConfig(num_draft_tokens=4)).generate([Request([4, 5], max_new_tokens=16,
                                                                                   stop_ids=())])
    with pytest.raises(CheckpointError, match="hidden' head, not 'markov'"):  # head mismatch with the checkpoint
        DFlyDrafter.from_pretrained(tmp_path / "d", target=target, head="markov")
    with pytest.raises(CheckpointError, match="holds a dfly drafter, not dspark"):
        DSparkDrafter.from_pretrained(tmp_path / "d", target=target)
    with pytest.raises(DrafterMismatchError, match="layer ids"):  # tap 2 does not exist on a 2-layer target
        DFlyDrafter.from_pretrained(tmp_path / "d", target=tiny_target(layers=2))
    with pytest.raises(DrafterMismatchError, match="fingerprint"):
        DFlyDrafter.from_pretrained(tmp_path / "d", target=tiny_target(vocab=24))
    with pytest.raises(DrafterMismatchError, match="layer"):
        drafter.check_compatible(tiny_target(layers=2).config)


# ---------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return conftest.write_conversations(tmp_path_factory.mktemp("block_data") / "conv.jsonl", 40, seed=7)




def test_train_two_steps_and_exact_resume(tmp_path, tiny_target_dir, conversations):
    cfg = replace(tiny_debug(), steps=2, ckpt_every=1)
    report = train_dfly(tiny_target_dir, conversations, tmp_path / "a", config=cfg, **QUIET)
    assert report["drafter"] == "dfly" and report["head"] == "hidden" and report["steps"] == 2
    train_dfly(tiny_target_dir, conversations, tmp_path / "b", config=cfg, max_minutes=0, **QUIET)  # stops at 1
    train_dfly(tiny_target_dir, conversations, tmp_path / "b", config=cfg, resume=True, **QUIET)
    a = conftest.same_weights(tmp_path / "a", tmp_path / "b")
    assert not any("embed_tokens" in k or "lm_head" in k for k in a)  # the target's E / W_lm are never saved
    logs = conftest.train_log(tmp_path / "a")
    assert [r["objective"] for r in logs] == ["dpace_lk", "e2e_tv"] and len(logs[0]["alpha_per_depth"]) == 4
    assert all(r["valid_anchors"] > 0 for r in logs)
    target = load_target(tiny_target_dir)
    drafter = get_drafter("dfly").from_pretrained(tmp_path / "a", target=target)
    drafter.check_compatible(target.config, num_draft_tokens=4)
    # Resuming with another head is refused: the checkpoint was trained with the hidden-correction head.
    from angelspec.train.checkpoint import ResumeError

    with pytest.raises(ResumeError, match="head"):
        train_dfly(tiny_target_dir, conversations, tmp_path / "b", config=replace(cfg, head="markov", steps=3),
                   resume=True, **QUIET)


@pytest.mark.parametrize("preset", [qwen3_8b_dfly, qwen3_8b_dspark])
def test_real_target_presets_build_and_run_one_step_scaled_down(tmp_path, tiny_target_dir, conversations, preset):
    from angelspec.train.overrides import with_overrides

    cfg = with_overrides(preset(), {"mask_token_id": "none", "seq_len": "64", "batch_size": "1", "num_anchors": "2",
                                    "steps": "1", "warmup": "1", "intermediate_size": "32", "markov_rank": "8"})
    report = train_block_drafter(tiny_target_dir, conversations, tmp_path / "q", config=cfg, **QUIET)
    assert report["steps"] == 1 and report["draft_layers"] == 5 and report["block_size"] == 8
    assert report["drafter"] == preset().drafter and report["objective"] == preset().resolved_objective


def test_only_the_large_target_presets_cap_the_teacher_at_the_reports_top_k():
    """Teacher top-K: the report's 10,000 in the Qwen3-8B presets (full-vocabulary targets at V = 152k are a memory
    risk), the full vocabulary (None) in the embedded-target presets (V = 8192)."""
    from angelspec.train import block, eagle3, mtp

    for module in (block, mtp, eagle3):
        for name, preset in module.PRESETS.items():
            assert preset().top_k == (10_000 if "8b" in name else None), (module.__name__, name)
    assert qwen3_8b_dfly().top_k == qwen3_8b_dspark().top_k == 10_000


def test_new_dspark_trains_with_the_reports_defaults_and_records_them(tmp_path, tiny_target_dir, conversations):
    """A new DSpark: same-layer injection, no fc at all, L_TV = ‖p − q‖₁; all of it in its config.json."""
    out = tmp_path / "dspark"
    train_block_drafter(tiny_target_dir, conversations, out, config=replace(tiny_debug(), drafter="dspark", steps=1),
                        **QUIET)
    raw = json.loads((out / "config.json").read_text())
    assert raw["block_drafter_config"]["context_injection"] == "same_layer"
    assert raw["block_drafter_config"]["fc_bias"] is False
    assert raw["angelspec"]["train_config"]["tv_norm"] == "l1"
    assert not any(k.startswith("fc.") for k in conftest.same_weights(out, out))
    target = load_target(tiny_target_dir)
    drafter = get_drafter("dspark").from_pretrained(out, target=target)
    assert drafter.model.config.context_taps == (0,)  # one draft layer, taps (0, 1) of the 2-layer target: the middle


def test_dspark_shipped_preset_still_builds_the_shipped_drafter():
    """The shipped DSpark predates the new defaults; its presets keep what it was trained with, so that `make
    drafters` rebuilds (and resumes) that drafter: the second stage's config equals the shipped folder's, and the
    first stage's differs only by the fused anchor input the second stage adds."""
    from angelspec.assets import DEFAULT_DRAFTERS
    from angelspec.models.block.presets import EMBEDDED_MASK_TOKEN_ID, embedded_target_shape

    folder = DEFAULT_DRAFTERS / "dspark" / "config.json"
    if not folder.is_file():
        pytest.skip("the shipped DSpark is not in this checkout")
    shipped = BlockDrafterConfig.from_dict(json.loads(folder.read_text())["block_drafter_config"])
    cfg = dspark_shipped_af()
    assert cfg.model_config(embedded_target_shape(), EMBEDDED_MASK_TOKEN_ID) == shipped and shipped.anchor_fusion
    assert (cfg.tv_norm, shipped.context_injection, shipped.fc_bias) == ("half_l1", "shared", True)
    first = dspark_shipped().model_config(embedded_target_shape(), EMBEDDED_MASK_TOKEN_ID)
    assert first == replace(shipped, anchor_fusion=False)


def test_a_run_checkpointed_before_the_new_settings_resumes_only_with_its_old_ones(tmp_path, tiny_target_dir,
                                                                                   conversations):
    """A checkpoint whose train_config lacks tv_norm / context_injection / fc_bias was made with ½‖p − q‖₁, the shared
    context and an fc bias: resuming it under the new DSpark defaults is refused, naming them; with the old
    settings it resumes exactly."""
    from angelspec.train.checkpoint import ResumeError

    old = replace(tiny_debug(), drafter="dspark", steps=2, ckpt_every=1, context_injection="shared", fc_bias=True,
                  tv_norm="half_l1")
    train_block_drafter(tiny_target_dir, conversations, tmp_path / "a", config=old, **QUIET)
    train_block_drafter(tiny_target_dir, conversations, tmp_path / "b", config=old, max_minutes=0, **QUIET)
    state_file = tmp_path / "b" / "training" / "checkpoint" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for key in ("tv_norm", "context_injection", "fc_bias"):  # as written before these settings existed
        del state["train_config"][key]
    state_file.write_text(json.dumps(state))
    new = replace(old, context_injection=None, fc_bias=None, tv_norm="l1")
    with pytest.raises(ResumeError, match="tv_norm: checkpoint 'half_l1'.*context_injection: checkpoint 'shared'"
                                          ".*fc_bias: checkpoint True"):
        train_block_drafter(tiny_target_dir, conversations, tmp_path / "b", config=new, resume=True, **QUIET)
    train_block_drafter(tiny_target_dir, conversations, tmp_path / "b", config=old, resume=True, **QUIET)
    conftest.same_weights(tmp_path / "a", tmp_path / "b")
    # A DFly run is untouched by the DSpark settings: its old checkpoint resumes under the new defaults.
    dfly = replace(tiny_debug(), drafter="dfly", steps=2, ckpt_every=1)
    train_block_drafter(tiny_target_dir, conversations, tmp_path / "c", config=dfly, max_minutes=0, **QUIET)
    state_file = tmp_path / "c" / "training" / "checkpoint" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for key in ("tv_norm", "context_injection", "fc_bias"):
        del state["train_config"][key]
    state_file.write_text(json.dumps(state))
    assert train_block_drafter(tiny_target_dir, conversations, tmp_path / "c", config=dfly, resume=True,
                               **QUIET)["steps"] == 2


def test_train_and_eval_from_the_cli(capsys, tmp_path, tiny_target_dir, conversations):
    from angelspec.cli import main

    prompts = conftest.write_domain_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "dfly"
    code = main(["train", "--drafter", "dfly", "--target", str(tiny_target_dir), "--data", str(conversations),
                 "--out", str(out), "--preset", "tiny_debug", "--quiet", "steps=2"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert f"dfly written to {out}" in stdout
    meta = json.loads((out / "config.json").read_text())["angelspec"]
    assert meta["drafter"] == "dfly" and meta["head"] == "hidden" and meta["objective"] == "dfly"
    code = main(["eval", "--target", str(tiny_target_dir), "--drafter", str(out), "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--quiet"])
    stdout, err = capsys.readouterr()
    assert code == 0 and "lossless: yes (3/3" in stdout, err


@pytest.mark.parametrize(("kind", "head"), [("dspark", "gated"), ("dspark", "rnn"), ("dflare", None),
                                           ("dfly", "markov")])
def test_every_kind_and_head_trains_one_step_and_decodes_losslessly(tmp_path, tiny_target_dir, conversations, kind,
                                                                    head):
    from angelspec.cli import main

    out = tmp_path / kind
    code = main(["train", "--drafter", kind, "--target", str(tiny_target_dir), "--data", str(conversations),
                 "--out", str(out), "--preset", "tiny_debug", "--quiet", "steps=1",
                 *(["--head", head] if head else [])])
    assert code == 0
    target = load_target(tiny_target_dir)
    drafter = get_drafter(kind).from_pretrained(out, target=target)
    assert drafter.kind == kind and drafter.model.config.head == (head or "none")
    reqs = [Request(list(range(10, 10 + n)), max_new_tokens=12, stop_ids=()) for n in (3, 7)]
    got = SpecEngine(target, drafter, EngineConfig(max_batch_size=2, num_draft_tokens=4)).generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------


def test_bad_train_configs_raise_clear_errors():
    with pytest.raises(ConfigError, match="block_size must be an int >= 2"):
        BlockDrafterTrainConfig(block_size=1)
    with pytest.raises(ConfigError, match="Markov-family"):
        BlockDrafterTrainConfig(drafter="dspark", head="hidden")
    with pytest.raises(ConfigError, match="is DSpark"):
        BlockDrafterTrainConfig(drafter="dflash", head="markov")
    with pytest.raises(ConfigError, match="unknown head"):
        BlockDrafterTrainConfig(head="lstm")
    with pytest.raises(ConfigError, match="unknown objective"):
        BlockDrafterTrainConfig(objective="ce")
    with pytest.raises(ConfigError, match="trains a dspark drafter, not dfly"):
        replace(tiny_debug(), drafter="dspark").for_kind("dfly")
    with pytest.raises(ConfigError, match="layer ids"):
        replace(tiny_debug(), target_layer_ids=(0, 7)).model_config(tiny_target().config, MASK)
    with pytest.raises(ConfigError, match="unknown context_injection 'fused'"):
        BlockDrafterTrainConfig(drafter="dspark", context_injection="fused")
    with pytest.raises(ConfigError, match="unknown tv_norm 'l2'"):
        BlockDrafterTrainConfig(drafter="dspark", tv_norm="l2")
    with pytest.raises(ConfigError, match="same_layer is DSpark's backbone"):
        replace(tiny_debug(), drafter="dflash", context_injection="same_layer").model_config(tiny_target().config,
                                                                                              MASK)


def test_mask_token_missing_or_out_of_range_is_a_clear_error(tmp_path, tiny_target_dir, conversations):
    class NoMask:
        mask_token_id = None

        def __len__(self) -> int:
            return VOCAB

    with pytest.raises(ConfigError, match="no mask token"):
        resolve_mask_token(NoMask(), None, VOCAB)
    assert resolve_mask_token(NoMask(), 2, VOCAB) == 2
    with pytest.raises(ConfigError, match="mask token id 999 is not in"):
        train_dfly(tiny_target_dir, conversations, tmp_path / "m", config=replace(tiny_debug(), mask_token_id=999),
                   **QUIET)
    assert not (tmp_path / "m").exists()  # refused before anything is written


def test_cli_bad_block_arguments(capsys, tmp_path, tiny_target_dir, conversations):
    from angelspec.cli import main

    base = ["train", "--target", str(tiny_target_dir), "--data", str(conversations), "--out", str(tmp_path / "o"),
            "--quiet", "--preset", "tiny_debug"]
    for extra, needle in [(["--drafter", "dfly", "block_size=1"], "block_size must be an int >= 2"),
                          (["--drafter", "dspark", "--head", "hidden"], "Markov-family"),
                          (["--drafter", "dfly", "target_layer_ids=0,5"], "layer ids"),
                          (["--drafter", "dfly", "mask_token_id=5000"], "mask token id 5000"),
                          (["--drafter", "dflash", "context_injection=same_layer"], "context_injection=shared"),
                          (["--drafter", "dspark", "tv_norm=l2"], "unknown tv_norm")]:
        code = main(base + extra)
        err = capsys.readouterr().err
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o" / "config.json").exists()


@needs_gloo
def test_two_processes_train_the_single_process_model(tmp_path, tiny_target_dir, conversations):
    """DDP over 2 ranks == one process on the same global batch (anchors are drawn per global row); tolerance as
    in test_distributed: float32 reduction order only."""
    from safetensors.torch import load_file

    train_dfly(tiny_target_dir, conversations, tmp_path / "one", config=replace(tiny_debug(), batch_size=4), **QUIET)
    proc = _torchrun("dfly", "ddp", tiny_target_dir, conversations, tmp_path / "ddp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, got = load_file(str(tmp_path / "one" / "model.safetensors")), load_file(str(tmp_path / "ddp" /
                                                                                     "model.safetensors"))
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("kind", ["dfly", "dfly" + FUSED])
def test_a_greedy_round_as_two_calls_drafts_what_the_joined_call_drafts(kind):
    """`join_catch_up = False`: the waiting commits' context append and the drafting pass as two calls."""
    target = tiny_target()
    model = tiny_block_drafter(target, kind)
    assert_two_calls_draft_as_joined(target, lambda: RecordingDrafter(model), random_requests(VOCAB, 3, 20, seed=5))


@pytest.mark.parametrize(("kind", "batch"), [("dspark", 2), ("dfly", 2), ("dfly", 1), ("dfly" + FUSED, 1)])
def test_compiled_block_drafter_stays_lossless_and_matches_eager(kind, batch):
    """EngineConfig(compile=True) compiles the verify forward and the drafter's greedy round: the waiting commits'
    context append and the drafting pass (backbone and head) as one graph, in place on the cache; outputs equal AR
    and the drafts equal the eager drafter's."""
    import warnings

    target = tiny_target()
    model = tiny_block_drafter(target, kind)
    rng = random.Random(3)
    reqs = [Request([rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))], max_new_tokens=20, stop_ids=())
            for _ in range(4)]
    eager = RecordingDrafter(model)
    SpecEngine(target, eager, EngineConfig(max_batch_size=batch, num_draft_tokens=3)).generate(reqs)
    compiled = RecordingDrafter(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # try_compile warns when it falls back to eager
        got = SpecEngine(target, compiled, EngineConfig(max_batch_size=batch, num_draft_tokens=3, compile=True)
                         ).generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference_generate(target, reqs)]
    assert compiled.proposals == eager.proposals


def test_compiled_block_drafter_admits_any_number_of_requests_without_compiling_mid_run():
    """Under load a request is admitted whenever one finishes: prefill appends the context of 1, 2, ... rows at once,
    a count the run before never saw. Compiled, each new count cost a fresh graph (about 20 s on 2 cores: a compiled
    serving point at C=16 ran at 0.05x of AR); prefill's append now runs eagerly, so a second run with other
    admission counts compiles nothing, and its outputs are still AR's."""
    target = tiny_target()
    assert_admissions_compile_nothing_mid_run(target, RecordingDrafter(tiny_block_drafter(target, "dfly")), VOCAB)
