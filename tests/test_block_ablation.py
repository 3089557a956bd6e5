"""benchmarks/block_ablation.py end to end on the tiny target: the default table (MTP, DFlash, DFly backbone,
+ Markov, + hidden correction) and a two-shape sweep train for two steps, evaluate losslessly at T=0, print the
paper's tables and a verdict per claim, reuse matching drafters on a rerun and refuse an unknown override."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import write_conversations, write_domain_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import block_ablation  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SMOKE = ["--steps", "2", "--limit", "1", "--max-new-tokens", "8", "--batch-size", "2", "--quiet",
         "seq_len=64", "num_anchors=4", "target_layer_ids=0,1", "intermediate_size=32", "markov_rank=8"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("block_ablation")
    return write_conversations(root / "conv.jsonl", 40, seed=3), write_domain_prompts(root / "prompts.jsonl")


def test_default_table_and_sweep_smoke(capsys, tmp_path, tiny_target_dir, files):
    conv, prompts = files
    common = ["--target", str(tiny_target_dir), "--data", str(conv), "--prompts", str(prompts),
              "--out", str(tmp_path), *SMOKE]
    assert block_ablation.main(common) == 0
    out, err = capsys.readouterr()
    assert "not lossless" not in err
    assert "Paper, Table 3" in out and "Paper, Table 4" in out and "Claims (ours vs the paper)" in out
    assert "K mtp 7, dflash 7, dfly_none 7, dfly_markov 7, dfly_hidden 7" in out
    res = json.loads((tmp_path / "tables3_4_block.json").read_text())
    assert set(res["results"]) == {"0.0", "1.0"}
    assert all(r["lossless"]["ok"] for r in res["results"]["0.0"].values())
    heads = {n: r.get("head") for n, r in res["train_reports"].items()}
    assert heads == {"mtp": None, "dflash": "none", "dfly_none": "none", "dfly_markov": "markov",
                     "dfly_hidden": "hidden"}
    assert len({r["steps"] for r in res["train_reports"].values()}) == 1  # the same budget for every drafter

    assert block_ablation.main([*common, "--sweep", "--sweep-blocks", "4,8", "--sweep-layers", "2"]) == 0
    out, _ = capsys.readouterr()
    assert "[dfly_hidden] reusing" in out  # L2-B8 is the default table's DFly
    assert "Paper, Table 5" in out and "L2: a longer block raises MAL" in out
    assert json.loads((tmp_path / "table5_sweep.json").read_text())["num_draft_tokens"] == {"dfly_b4_l2": 3,
                                                                                         "dfly_hidden": 7}


def test_unknown_override_is_refused(tiny_target_dir, files, tmp_path):
    conv, prompts = files
    with pytest.raises(SystemExit, match="no trained config has the field"):
        block_ablation.main(["--target", str(tiny_target_dir), "--data", str(conv), "--out", str(tmp_path),
                             "--steps", "1", "stpes=3"])
