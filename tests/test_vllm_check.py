"""The parts of `make vllm-check` that need no vLLM: how vLLM's acceptance counters become p_1..p_K in our
definition, and when a drafter's row passes (`pipelines.vllm_check`, `decoding.vllm_engine`)."""

from __future__ import annotations

import pytest

from angelspec.decoding.metrics import DecodeMetrics
from angelspec.decoding.vllm_engine import SpecCounters
from angelspec.pipelines.vllm_check import DrafterCheck, VllmCheckReport, VllmCheckSettings


def test_vllm_counters_give_our_p_k():
    """vLLM counts, per verify step of one request, the drafts whose first j tokens were accepted; our metrics
    count the same steps in a histogram of accepted drafts: both must give the same p_1..p_K."""
    accepted = [0, 0, 1, 3, 2, 0, 1, 3, 3, 0]  # drafts accepted per verify step, K = 3
    ours = DecodeMetrics(num_draft_tokens=3)
    ours.record_verify(accepted, [3] * len(accepted), "greedy")
    before = SpecCounters(5, 15, (4, 2, 1))  # an earlier run on the same engine
    after = SpecCounters(5 + len(accepted), 15 + 3 * len(accepted),
                         tuple(b + sum(a >= j for a in accepted) for j, b in zip((1, 2, 3), (4, 2, 1), strict=True)))
    run = after - before
    assert run.drafts == ours.row_steps == 10 and run.draft_tokens == 30
    assert run.acceptance == pytest.approx(ours.acceptance)
    assert run.mean_accepted_length == pytest.approx(ours.mean_accepted_length)
    assert SpecCounters().acceptance == [] and SpecCounters().mean_accepted_length == 0.0


def _row(**changes) -> DrafterCheck:
    row = dict(name="eagle3", method="eagle3", k=3, prompts=12, ours_equal_ar=12, vllm_equal_ar=12,
               ours=[0.3, 0.1, 0.02], vllm=[0.31, 0.1, 0.06], ours_steps=400, vllm_steps=400, taps=[1, 3, 4],
               vllm_taps=[2, 4, 5])
    return DrafterCheck(**{**row, **changes})


@pytest.mark.parametrize(("changes", "passes"), [
    ({}, True),
    ({"vllm": [0.31, 0.1, 0.08]}, False),  # p_3 differs by 0.06 > 0.05
    ({"vllm_equal_ar": 11}, False),  # one vLLM output differs from AR
    ({"ours_equal_ar": 11}, False),
    ({"vllm_taps": [1, 3, 4]}, False),  # vLLM tapped our ids unshifted (trap 2)
    ({"vllm": [0.3, 0.1]}, False),  # vLLM reported another K
    ({"taps": None, "vllm_taps": None}, True),  # a draft LM taps nothing
])
def test_a_drafter_row_passes_only_when_every_condition_holds(changes, passes):
    row = _row(**changes)
    assert row.passed(0.05) is passes
    report = VllmCheckReport(VllmCheckSettings(), [row], {"identical": True}, {"passed": True}, "0.32.0", 1.0)
    assert report.passed is passes
    assert ("| pass |" if passes else "| FAIL |") in report.format().splitlines()[3]
    assert VllmCheckReport(VllmCheckSettings(), [row], {"identical": False}, {"passed": True}).passed is False


def test_vllm_engine_module_imports_neither_torch_nor_vllm():
    """`benchmarks/vllm_check.py` and the serving benchmark's vLLM column read `CPU_ENV` from this module before
    torch starts (one compute thread only takes effect that way), so importing it must not start torch."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import angelspec

    code = ("import sys; from angelspec.decoding.vllm_engine import CPU_ENV; "
            "print(CPU_ENV['OMP_NUM_THREADS'], [m for m in ('torch', 'vllm') if m in sys.modules])")
    src = str(Path(angelspec.__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": src})
    assert out.stdout.split() == ["1", "[]"], out


def test_vllm_runs_with_one_numba_thread():
    """vLLM's n-gram proposer runs in numba; with numba's default pool (one worker per core) vLLM's n-gram speculation
    ran 45x slower on this 2-core machine, so every vLLM process here gets one numba thread."""
    from angelspec.decoding.vllm_engine import CPU_ENV

    assert CPU_ENV["NUMBA_NUM_THREADS"] == "1" and CPU_ENV["OMP_NUM_THREADS"] == "1"


def test_every_drafter_the_check_serves_is_exportable(tmp_path):
    """`make vllm-check` exports each drafter it serves before starting vLLM: the shipped EAGLE-3, draft LM, MTP and
    DFly, the two-layer DFlare it makes from the DFly, the DFlash it trains (built here with random weights from the
    check's own training config) and the random DSpark it loads through vLLM's model class. None of them may be
    refused (a new DSpark defaults to same-layer injection, which vLLM cannot serve)."""
    from angelspec.assets import DEFAULT_TARGET
    from angelspec.data.tokenizer import load_tokenizer
    from angelspec.export import export_drafter
    from angelspec.models import read_config
    from angelspec.pipelines.vllm_check import (
        dflash_check_config,
        random_block_drafter,
        random_dspark_source,
        served_drafters,
        two_layer_dflare,
    )
    from angelspec.train.block import resolve_mask_token

    target = read_config(DEFAULT_TARGET)
    mask = resolve_mask_token(load_tokenizer(DEFAULT_TARGET), None, target.vocab_size)
    dflash = random_block_drafter(dflash_check_config().model_config(target, mask), tmp_path / "dflash")
    sources = {name.split()[0]: src for name, src, _ in served_drafters(dflash, [], two_layer_dflare(tmp_path / "fl"))}
    sources["dspark"] = random_dspark_source(tmp_path / "dspark")
    methods = {name: export_drafter(src, tmp_path / "exports" / name).speculative_config["method"]
               for name, src in sources.items()}
    assert methods == {"eagle3": "eagle3", "draft": "draft_model", "mtp": "eagle3", "dfly": "dflash",
                       "dflash": "dflash", "dflare": "dflash", "dspark": "dspark"}


def test_the_llama_case_builds_a_llama_target_and_echo_drafters_exports_and_decodes_before_vllm(tmp_path, monkeypatch):
    """Check 3 up to the vLLM engine: a Llama 3-shaped target (no q/k norm, untied head, llama3 RoPE); the echo
    EAGLE-3 (vLLM's Llama class), MTP (a Llama layer, the plugin's class) and DFly (Qwen3 layers, the plugin's
    class), whose first drafts our engine accepts; each with our engine's row, handed to `_serve_in_vllm` with the
    Llama target."""
    import json

    from angelspec.models import read_config
    from angelspec.pipelines import vllm_check

    handed = []

    def serve(served, prompts, ar, settings, log, target):
        handed.append(dict(served=served, prompts=prompts, ar=ar, target=target))
        return _row(name=served.name, k=served.k)

    monkeypatch.setattr(vllm_check, "_serve_in_vllm", serve)
    settings = VllmCheckSettings(out_dir=tmp_path, per_domain=1, max_new_tokens=24, only="llama")
    rows = vllm_check._llama_check(settings, tmp_path, log=lambda *_: None)
    want = {"eagle3": (["LlamaForCausalLMEagle3"], "llama", "eagle3"),
            "mtp": (["AngelSpecMTPEagle3"], "llama", "eagle3"),
            "dfly": (["AngelSpecDFlyDFlash"], "qwen3", "dflash")}
    assert [h["served"].name.split()[0] for h in handed] == list(want)
    for h in handed:
        target = read_config(h["target"])
        assert (target.model_type, target.qk_norm, target.tie_word_embeddings, target.rope_type) == (
            "llama", False, False, "llama3")
        served = h["served"]
        cfg = json.loads((served.export / "config.json").read_text())
        kind = served.name.split()[0]
        assert (cfg["architectures"], cfg["model_type"]) == want[kind][:2]
        assert json.loads((served.export / "speculative_config.json").read_text())["method"] == want[kind][2]
        assert served.outputs == h["ar"] and len(h["prompts"]) == 3  # ours is lossless on the Llama target
        taps = cfg.get("eagle_aux_hidden_state_layer_ids") or cfg["dflash_config"]["target_layer_ids"]
        assert taps == ([t + 1 for t in served.taps] if kind != "dfly" else served.taps)  # vLLM adds 1 for DFlash
        assert served.metrics.acceptance[0] > 0.1, (kind, served.metrics.acceptance)  # enough to compare p_1
    report = VllmCheckReport(settings, rows, {}, {}, "0.32.0", 1.0)
    assert report.passed and "rollout" not in report.format() and "dspark (load only)" not in report.format()
    one = VllmCheckSettings(out_dir=tmp_path / "one", per_domain=1, max_new_tokens=4, only="llama-mtp")
    handed.clear()
    vllm_check._llama_check(one, tmp_path / "one", log=lambda *_: None)
    assert [h["served"].name.split()[0] for h in handed] == ["mtp"]
