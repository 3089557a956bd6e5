"""The small file helpers of `angelspec.fileio` and the writers built on them: written files get the permissions
a plain `open()` would give (0666 minus the umask), whatever library writes the bytes."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from angelspec.fileio import write_json_atomic, write_jsonl_atomic
from angelspec.models.hf_io import save_safetensors_atomic


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_honour_the_umask(tmp_path: Path, umask: int) -> None:
    """safetensors writes through its own private (0600) temp file; JSON through `open`: both end as `open` would."""
    want = 0o666 & ~umask
    save_safetensors_atomic({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    write_json_atomic(tmp_path / "config.json", {"a": 1})
    write_jsonl_atomic(tmp_path / "sub" / "rows.jsonl", [{"a": 1}])
    for name in ("model.safetensors", "config.json", "sub/rows.jsonl"):
        assert _mode(tmp_path / name) == want, f"{name}: {oct(_mode(tmp_path / name))} != {oct(want)}"
    # Overwriting keeps following the umask (not the mode of the file it replaces).
    os.chmod(tmp_path / "model.safetensors", 0o600)
    save_safetensors_atomic({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    assert _mode(tmp_path / "model.safetensors") == want


def test_the_shipped_bf16_export_honours_the_umask(tmp_path: Path, umask: int) -> None:
    from safetensors.torch import load_file, save_file

    from angelspec.pipelines.shipped import _bf16_weights

    save_file({"w": torch.ones(2)}, str(tmp_path / "src.safetensors"))
    _bf16_weights(tmp_path / "src.safetensors", tmp_path / "model.safetensors")
    assert load_file(str(tmp_path / "model.safetensors"))["w"].dtype == torch.bfloat16
    assert _mode(tmp_path / "model.safetensors") == 0o666 & ~umask


# ----- outputs: not an input --------------------------------------------------------------------------------------
def test_refuse_same_file_sees_through_other_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from angelspec.errors import UsageError
    from angelspec.fileio import refuse_same_file

    src = tmp_path / "in.jsonl"
    src.write_text("x\n")
    (tmp_path / "soft.jsonl").symlink_to(src)
    (tmp_path / "hard.jsonl").hardlink_to(src)
    (tmp_path / "d").mkdir()
    monkeypatch.chdir(tmp_path)
    for same in (src, tmp_path / "soft.jsonl", tmp_path / "hard.jsonl", Path("d/../in.jsonl"), Path("in.jsonl")):
        with pytest.raises(UsageError, match=r"--json .* is the same file as the input --prompts .*--json another"):
            refuse_same_file(same, ("--cost-table", None), ("--prompts", src), flag="--json")
    refuse_same_file(tmp_path / "out.jsonl", ("--prompts", src))  # a new file
    refuse_same_file(tmp_path / "d" / "in.jsonl", ("--prompts", src), ("--eval", None))  # another file, same name
    assert src.read_text() == "x\n"
