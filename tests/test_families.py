"""One record per drafter family: the decoding half (`decoding.drafters.families`) and the training half
(`train.registry`) agree with each other and with the code they name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import tiny_decoder

from angelspec.decoding.drafters import DraftLMDrafter, NGramDrafter, families, family_of, get_family
from angelspec.decoding.drafters.base import full_depth_drafting
from angelspec.decoding.drafters.block import BlockDrafterAdapter
from angelspec.decoding.drafters.calibrated import CalibratedDrafter
from angelspec.decoding.loading import draft_depth, drafter_forms
from angelspec.decoding.policies.sts import StsCalibration
from angelspec.export.checks import ExportRefused
from angelspec.models.block.config import DRAFTER_KINDS
from angelspec.models.mtp_io import MTP_FAMILY
from angelspec.train.registry import BLOCK_DRAFTERS, SP_DRAFTERS, TRAINABLE, trainable

SRC = Path(__file__).resolve().parents[1] / "src" / "angelspec"


def test_every_trainable_family_is_a_drafter_family_with_its_presets() -> None:
    for name, record in TRAINABLE.items():
        family = record.family()
        assert family.name == name and family.saved and family.block == record.block
        train_fn, presets = record.load()
        assert callable(train_fn) and record.default_preset in presets
        assert record.real_size_preset is None or record.real_size_preset in presets
    assert set(BLOCK_DRAFTERS) == {f.name for f in families() if f.block} == set(DRAFTER_KINDS)
    assert "draft-lm" not in SP_DRAFTERS and {"mtp", "eagle3", *BLOCK_DRAFTERS} == set(SP_DRAFTERS)
    with pytest.raises(KeyError, match="trainable: draft-lm"):
        trainable("ngram")


def test_the_records_name_the_classes_that_load_each_family() -> None:
    assert get_family("ngram").drafter is NGramDrafter and not get_family("ngram").saved
    for f in families():
        if f.block:
            assert issubclass(f.drafter, BlockDrafterAdapter) and f.drafter.kind == f.name
        elif f.name in MTP_FAMILY:
            assert f.model is MTP_FAMILY[f.name][1] and f.drafter.kind == f.name
    assert drafter_forms().count(":DIR") == sum(f.saved for f in families())


def test_export_formats_in_the_records_match_the_exporters() -> None:
    """A family lists `vllm` exactly when the vLLM exporter knows its folders, and SGLang refuses the MTP family."""
    from angelspec.export.sglang import _screen

    vllm = {f.name for f in families() if "vllm" in f.exports}
    assert vllm == {"draft-lm", *MTP_FAMILY, *DRAFTER_KINDS}
    for name in MTP_FAMILY:
        assert "sglang" not in get_family(name).exports
        with pytest.raises(ExportRefused):
            _screen(name, {})


def test_default_depth_comes_from_the_drafter_then_its_family() -> None:
    target = tiny_decoder()
    lm = DraftLMDrafter(target)
    assert family_of(lm) is get_family("draft-lm") and lm.trained_depth is None
    assert draft_depth(lm) == get_family("draft-lm").default_depth == 4
    assert draft_depth(NGramDrafter()) == 4 and draft_depth(lm, 2) == 2 and draft_depth(None) == 4


def test_full_depth_drafting_reaches_through_wrappers() -> None:
    """Calibration and cost profiling switch a draft LM's early stop off and have the lookup draft every row, wrapped
    in a calibration or not, and switch both back after."""
    lm = DraftLMDrafter(tiny_decoder(), stop_below=0.4)
    lookup = NGramDrafter()
    calibration = StsCalibration(temperatures=(1.0,))
    for drafter in (lm, CalibratedDrafter(lm, calibration), lookup, CalibratedDrafter(lookup, calibration)):
        with full_depth_drafting(drafter):
            assert (lm.stop_below is None) != lookup.draft_every_row
        assert lm.stop_below == 0.4 and lookup.draft_every_row is False


def test_the_registries_import_what_they_name() -> None:
    """The trainer records reach their modules through import statements (the layer check sees every arrow), and no
    module of the package imports by string."""
    tree = ast.parse((SRC / "train" / "registry.py").read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {"angelspec.train.draft_lm", "angelspec.train.mtp", "angelspec.train.eagle3",
            "angelspec.train.block"} <= imported
    for path in SRC.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "import_module(" not in text and "__import__(" not in text, path
