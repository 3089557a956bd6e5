"""The draft-LM baseline trains against a target folder, resumes, and loads as a drafter tied to its target."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import synthetic_sentences

from angelspec.train.draft_lm import draft_lm_tiny_debug, train_draft_lm


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "conv.jsonl"
    lines = list(synthetic_sentences(80, seed=3))
    with open(path, "w") as f:
        for q, a in zip(lines[::2], lines[1::2], strict=False):
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                    + "\n")
    return path


def test_train_then_load_as_drafter(tmp_path, tiny_target_dir, conversations):
    from angelspec.decoding.drafters.draft_lm import DraftLMDrafter
    from angelspec.models import read_config

    out = tmp_path / "draft"
    report = train_draft_lm(tiny_target_dir, conversations, out, config=draft_lm_tiny_debug(), progress=False,
                            log=lambda *_: None)
    assert report["steps"] == 4
    raw = json.loads((out / "config.json").read_text())
    assert raw["angelspec"]["drafter"] == "draft-lm"
    assert raw["num_hidden_layers"] == 1
    assert (out / "tokenizer.json").is_file()
    drafter = DraftLMDrafter.from_pretrained(out)
    target_cfg = read_config(tiny_target_dir)
    drafter.check_compatible(target_cfg)  # same fingerprint, vocab and eos: no error
    # the embedding started from the target's and was trained from there
    from angelspec.models import load_target

    assert not torch.equal(drafter.model.embed_tokens.weight, load_target(tiny_target_dir).embed_tokens.weight)


def test_resume_matches_uninterrupted_run(tmp_path, tiny_target_dir, conversations):
    from angelspec.models import load_target

    kw = dict(config=draft_lm_tiny_debug(), progress=False, log=lambda *_: None)
    train_draft_lm(tiny_target_dir, conversations, tmp_path / "a", **kw)
    train_draft_lm(tiny_target_dir, conversations, tmp_path / "b", max_minutes=0, **kw)
    train_draft_lm(tiny_target_dir, conversations, tmp_path / "b", resume=True, **kw)
    a, b = load_target(tmp_path / "a").state_dict(), load_target(tmp_path / "b").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(FileExistsError, match="--force"):
        train_draft_lm(tiny_target_dir, conversations, tmp_path / "a", **kw)


def test_bad_data_path_is_a_clear_error(tmp_path, tiny_target_dir):
    with pytest.raises(FileNotFoundError, match="expected a JSONL file"):
        train_draft_lm(tiny_target_dir, tmp_path / "missing", tmp_path / "o", config=draft_lm_tiny_debug(),
                       progress=False)
