"""`angelspec target build` end to end on a synthetic corpus: exported folder loads with HF, a killed
run resumes to exactly the weights of an uninterrupted one, and a half-written checkpoint is never used."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from angelspec.models import load_target
from angelspec.train.checkpoint import ResumeError, find_checkpoint
from angelspec.train.target import build_target, tiny_debug


def _write_corpus(root, n=60, seed=0):
    rng = random.Random(seed)
    words = "the cat sat on a mat while python code runs def return value list add sum".split()
    for domain in ("code", "math", "chat"):
        for split, count in (("train", n), ("heldout", 6)):
            d = root / domain
            d.mkdir(parents=True, exist_ok=True)
            with open(d / f"{split}.jsonl", "w") as f:
                for _ in range(count):
                    q = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
                    a = " ".join(rng.choice(words) for _ in range(rng.randint(5, 30)))
                    msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                    f.write(json.dumps({"messages": msgs, "domain": domain}) + "\n")
    return root


def _weights(folder):
    return {k: v.clone() for k, v in load_target(folder).state_dict().items()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


CFG = replace(tiny_debug(), steps=6, ckpt_every=2, bf16=False)


def test_build_exports_a_loadable_model_and_resume_is_exact(tmp_path, corpus):
    full = build_target(tmp_path / "full", work_dir=tmp_path / "w_full", config=CFG, corpus_dir=corpus,
                        progress=False, log=lambda *_: None)
    assert full["steps"] == 6 and set(full["heldout_loss"]) == {"code", "math", "chat"}
    info = json.loads((tmp_path / "full" / "build_info.json").read_text())
    assert info["parameters"] > 0
    # Interrupted run: stop after the first step (time budget 0), then resume to the end.
    build_target(tmp_path / "part", work_dir=tmp_path / "w_part", config=CFG, corpus_dir=corpus,
                 progress=False, max_minutes=0, log=lambda *_: None)
    ckpt = find_checkpoint(tmp_path / "w_part" / "checkpoint")
    assert ckpt is not None and json.loads((ckpt / "trainer_state.json").read_text())["step"] == 1
    build_target(tmp_path / "part", work_dir=tmp_path / "w_part", config=CFG, corpus_dir=corpus,
                 progress=False, resume=True, log=lambda *_: None)
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "part")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_exported_folder_loads_with_transformers(tmp_path, corpus):
    transformers = pytest.importorskip("transformers")
    build_target(tmp_path / "out", work_dir=tmp_path / "w", config=replace(CFG, steps=2), corpus_dir=corpus,
                 progress=False, log=lambda *_: None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ours = load_target(tmp_path / "out")
    ids = tok.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max() < 1e-4


def test_refuses_to_overwrite_and_to_resume_a_different_run(tmp_path, corpus):
    kw = dict(work_dir=tmp_path / "w", corpus_dir=corpus, progress=False, log=lambda *_: None)
    build_target(tmp_path / "out", config=replace(CFG, steps=2), **kw)
    with pytest.raises(FileExistsError, match="--force"):
        build_target(tmp_path / "out", config=replace(CFG, steps=2), **kw)
    with pytest.raises(ResumeError, match="settings differ"):
        build_target(tmp_path / "out", config=replace(CFG, steps=2, lr=1e-2), resume=True, **kw)
    # Changing only the run length is allowed: extend the finished run by two steps.
    report = build_target(tmp_path / "out", config=replace(CFG, steps=4), resume=True, **kw)
    assert report["steps"] == 4


def test_resume_without_a_checkpoint_keeps_the_finished_model(capsys, tmp_path):
    """`target build --resume` on an --out that holds a model (its default is the shipped target) with no checkpoint
    in --work-dir has nothing to resume: refused before anything is written, instead of training a new target from
    scratch over the model; --force is the way to do that."""
    import conftest

    out, work = tmp_path / "target", tmp_path / "w"
    out.mkdir()
    (out / "config.json").write_text('{"finished": true}')
    (out / "model.safetensors").write_text("trained weights")
    code, _, err = conftest.run_cli(capsys, "target", "build", "--out", out, "--work-dir", work, "--preset",
                                    "tiny_debug", "--resume", "--quiet")
    conftest.assert_bad_input(code, err, str(out), "no checkpoint", "nothing to resume", "--force",
                              "new training run")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == '{"finished": true}'
    assert (out / "model.safetensors").read_text() == "trained weights"
    assert not work.exists()


@pytest.mark.usefixtures("one_thread")
def test_resume_without_a_checkpoint_or_a_model_starts_from_scratch(tmp_path, corpus):
    """A build killed before its first checkpoint (nothing exported yet) still continues with --resume, from step 0."""
    (tmp_path / "w").mkdir()  # the kill left the work folder but no checkpoint
    (tmp_path / "out").mkdir()  # and an empty output folder
    logged: list[str] = []
    report = build_target(tmp_path / "out", work_dir=tmp_path / "w", config=replace(CFG, steps=1), resume=True,
                          corpus_dir=corpus, progress=False, log=logged.append)
    assert report["steps"] == 1 and any("starting from scratch" in line for line in logged)
    assert load_target(tmp_path / "out").config.num_hidden_layers == CFG.num_hidden_layers


def test_a_kill_between_renames_keeps_the_previous_checkpoint(tmp_path):
    from angelspec.train.checkpoint import write_checkpoint

    ckpt = tmp_path / "checkpoint"
    write_checkpoint(ckpt, lambda p: (p / "config.json").write_text("{}"), {"step": 1})
    # Simulate a kill after `latest -> latest.old` but before `tmp -> latest`.
    ckpt.rename(tmp_path / "checkpoint.old")
    (tmp_path / "checkpoint.tmp-999").mkdir()  # a half-written new checkpoint
    found = find_checkpoint(ckpt)
    assert found == tmp_path / "checkpoint.old"
    assert json.loads((found / "trainer_state.json").read_text())["step"] == 1
