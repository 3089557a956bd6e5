"""One grammar for drafter specs (`decoding.drafter_spec`): `--drafter`, the folder a spec names and the bench's
`NAME=SPEC[@POLICY][+gate][+compile]` are read by the same parser; K is checked by one function."""

from __future__ import annotations

from pathlib import Path

import pytest

from angelspec.decoding.drafter_spec import (
    BenchEntry,
    DrafterSpec,
    LookupSpec,
    parse_bench_entry,
    parse_drafter_spec,
)
from angelspec.decoding.drafters.base import DrafterMismatchError
from angelspec.decoding.drafters.ngram import NGramDrafter
from angelspec.decoding.limits import check_num_draft_tokens
from angelspec.decoding.loading import draft_depth, drafter_path
from angelspec.errors import UsageError
from angelspec.eval.serving import ServingConfig, ServingError, parse_config


def test_every_form_parses_into_one_typed_spec() -> None:
    assert parse_drafter_spec(None) == parse_drafter_spec("none") == DrafterSpec("none", "none")
    assert parse_drafter_spec("none").is_none and not parse_drafter_spec("ngram").is_none
    assert parse_drafter_spec("ngram") == DrafterSpec("ngram", "ngram", max_ngram=3)
    assert parse_drafter_spec("ngram:5").max_ngram == 5
    assert parse_drafter_spec("dfly:/x/y") == DrafterSpec("dfly:/x/y", "dfly", Path("/x/y"))
    assert parse_drafter_spec("runs/a") == DrafterSpec("runs/a", None, Path("runs/a"))  # kind from its config.json
    hybrid = parse_drafter_spec("dfly:/x+ngram:4:2:3")
    assert (hybrid.kind, hybrid.folder, hybrid.base) == ("dfly", Path("/x"), "dfly:/x")
    assert hybrid.lookup == LookupSpec(4, 2, 3) and parse_drafter_spec("a+ngram").lookup == LookupSpec(3, 1, None)
    spec = parse_drafter_spec("ngram:2")
    assert parse_drafter_spec(spec) is spec


@pytest.mark.parametrize(("text", "needle"), [
    ("dfly", "needs the folder it was saved in: dfly:DIR"),
    ("mtp:", "needs the folder"),
    ("ngram:0", "positive integer N"),
    ("ngram:999", "at most 64"),
    ("none+ngram", "in front of a model drafter"),
    ("ngram+ngram", "in front of a model drafter"),
    ("d+ngram:3:1:1:1", r"SPEC\+ngram\[:N\[:M\[:D\]\]\]"),
])
def test_a_bad_spec_is_one_line_naming_the_form(text: str, needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        parse_drafter_spec(text)


def test_the_folder_of_a_spec_is_what_the_parser_read() -> None:
    for text in ("dfly:/x/y", "/x/y", "/x/y+ngram:3", "draft-lm:/x/y+ngram"):
        assert drafter_path(text) == Path("/x/y")
    assert drafter_path("ngram") == Path("ngram")  # not a folder: the calibration refuses it by name


def test_the_bench_grammar_is_the_same_parser() -> None:
    text = "DFly+NG=dfly:DIR+ngram:3:2@dcut+gate+compile"
    assert parse_bench_entry(text) == BenchEntry("DFly+NG", "dfly:DIR+ngram:3:2", "dcut", True, True)
    assert parse_config(text) == ServingConfig("DFly+NG", "dfly:DIR+ngram:3:2", "dcut", spec_gate=True, compile=True)
    with pytest.raises(ServingError, match="needs the folder it was saved in"):
        parse_config("X=dfly@dcut")  # the drafter spec is read when the configuration is, before any weights
    with pytest.raises(UsageError, match="AR \\(drafter none\\) never drafts"):
        parse_bench_entry("AR=none+gate")


def test_k_is_checked_by_one_function() -> None:
    for bad in (0, -1, 65, float("nan")):
        with pytest.raises(UsageError, match="^num_draft_tokens must be at least 1 and at most 64"):
            check_num_draft_tokens(bad)
        with pytest.raises(UsageError, match="^num_draft_tokens"):
            draft_depth(NGramDrafter(), bad)
    for bad in (True, "3", 2.5):
        with pytest.raises(UsageError, match="^num_draft_tokens must be a positive integer"):
            check_num_draft_tokens(bad)
    with pytest.raises(UsageError, match=r"at most 14 \(the target's context is 16 tokens\)"):
        check_num_draft_tokens(15, context=16)
    check_num_draft_tokens(14, context=16)


def test_a_drafter_bounds_its_depth_through_wrappers() -> None:
    from test_block_engine import tiny_block_drafter, tiny_target

    from angelspec.decoding.drafters.block import BlockDrafterAdapter
    from angelspec.decoding.drafters.calibrated import CalibratedDrafter
    from angelspec.decoding.policies.sts import StsCalibration

    target = tiny_target()
    block = BlockDrafterAdapter(tiny_block_drafter(target, "dfly"))
    wrapped = CalibratedDrafter(block, StsCalibration(temperatures=(1.0,)))
    bound = block.max_draft_tokens
    assert wrapped.max_draft_tokens == bound and NGramDrafter().max_draft_tokens is None
    wrapped.check_depth(bound)
    NGramDrafter().check_depth(64)
    with pytest.raises(DrafterMismatchError, match=f"at most {bound} drafts per step"):
        wrapped.check_depth(bound + 1)


def test_the_command_line_builds_the_typed_settings_the_library_takes() -> None:
    """`generate` and `eval` parse their flags once into a `DecodeSettings` (and the drafter into a DrafterSpec)."""
    from angelspec.cli import build_parser
    from angelspec.cli.common import decode_settings
    from angelspec.decoding.settings import DecodeSettings

    args = build_parser().parse_args(
        ["eval", "--drafter", "ngram:2", "--num-draft-tokens", "5", "--max-new-tokens", "9", "--batch-size", "3",
         "--temperature", "0.5", "--top-p", "0.9", "--top-k", "7", "--seed", "4", "--policy", "dcut", "--spec-gate",
         "--compile"])
    assert decode_settings(args, compile=args.compile) == DecodeSettings(
        num_draft_tokens=5, max_new_tokens=9, batch_size=3, temperature=0.5, top_p=0.9, top_k=7, seed=4,
        policy="dcut", spec_gate=True, compile=True)
    generate = build_parser().parse_args(["generate", "--prompts", "p.jsonl", "--out", "o.jsonl"])
    settings = decode_settings(generate)
    assert settings.num_draft_tokens is None and settings.seed is None and settings.max_new_tokens == 256
    with pytest.raises(UsageError, match="^num_draft_tokens must be at least 1"):
        DecodeSettings(num_draft_tokens=0).check_counts()
