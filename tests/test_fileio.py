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


# ----- outputs: not an input, and writable -------------------------------------------------------------------------
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


def test_check_writable_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from angelspec.errors import UsageError
    from angelspec.fileio import check_writable_path

    check_writable_path(tmp_path / "o.jsonl")
    check_writable_path(tmp_path / "new" / "deeper" / "o.jsonl")  # folders that will be created
    monkeypatch.chdir(tmp_path)
    check_writable_path("o.jsonl")
    blocker = tmp_path / "file"
    blocker.write_text("")
    for bad in (blocker / "o.jsonl", blocker / "a" / "b" / "o.jsonl"):
        with pytest.raises(UsageError, match=f"--out {bad} is a path under {blocker}, which is a file, not a folder"):
            check_writable_path(bad)
    assert not (tmp_path / "new").exists()  # nothing was created
    # A folder without write permission (faked: root's os.access says yes to everything).
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    with pytest.raises(UsageError, match=f"the folder, {locked}, is not writable"):
        check_writable_path(locked / "o.jsonl", "--json")
    with pytest.raises(UsageError, match=f"the folder in which {locked / 'sub'} would be created, {locked}, is not"):
        check_writable_path(locked / "sub" / "o.jsonl")
