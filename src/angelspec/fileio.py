"""Small file helpers with no heavy imports (the CLI's parser imports them, so `--help` stays instant).

Every write goes to a temp file in the destination folder and is renamed over the target, so a crash never
leaves a half-written file. The written file gets ordinary permissions (0666 minus the umask, like `open`
would give) because a private 0600 (`mkstemp`'s, or that of a writer such as safetensors that swaps its own temp
file in) would otherwise survive the rename into checkpoints users share.
`check_output_path` refuses, before any work, an output that is a folder, that exists without --force, or whose
folder cannot be made or written (`check_writable_path`); `refuse_same_file` refuses an output that is an input.
`require_memory` refuses, before any work, a setting whose buffers could not fit in the memory this machine has free.
`staged_folder` fills an output folder beside its final place and swaps it in whole, so a failure leaves the old one.
`copy_files` fills a folder about to be swapped in (train/checkpoint.py's `replace_folder`) without writing through
a file it shares.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from angelspec.errors import UsageError


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine: the owner of a lock, a temp folder or a run that may have been
    killed. An exited process its parent has not reaped yet (a zombie) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    except OSError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): os.kill's answer stands
    return state != "Z"


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo: the memory this machine can give a new allocation without swapping (None
    where it cannot be read: not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


BYTE_UNITS = {"KiB": ("B", "KiB", "MiB", "GiB", "TiB"),  # the IEC names
              "KB": ("B", "KB", "MB", "GB", "TB")}  # the same powers of 1024, under the older names


def human_bytes(nbytes: float, units: str = "KiB") -> str:
    """A size in powers of 1024, named by `units` (a key of BYTE_UNITS): 1536 -> '1.5 KiB', or '1.5 KB'."""
    names = BYTE_UNITS[units]
    for unit in names:
        if nbytes < 1024 or unit == names[-1]:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable: the last unit always returns")


def require_memory(name: str, need_bytes: int, what: str, available: int | None = None,
                   lower: str | None = None, where: str = "this machine") -> None:
    """Refuse, before any work, a setting (`name`, the flag the message names; `lower`, what to lower, default
    `name`) whose buffers (`what`, `need_bytes`) exceed 90% of the memory free (`available`, default
    /proc/meminfo's; `where` names whose it is, e.g. a GPU's), instead of being killed by the kernel later. Skipped
    where it cannot be read."""
    available = available_memory_bytes() if available is None else available
    if available is not None and need_bytes > 0.9 * available:
        raise UsageError(f"{name}: {what} need about {human_bytes(need_bytes)}, but {where} has "
                         f"{human_bytes(available)} of memory free; lower {lower or name}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def replace_atomic(path: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Call `write(tmp_path)` for a temp file beside `path`, then rename it over `path` with the mode `open` would
    give. The mode is set after `write`, which may have replaced the temp file with one of its own."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def staged_folder(out: str | os.PathLike[str]) -> Iterator[Path]:
    """A temp folder beside `out` for the caller to fill. When the block ends without an error it replaces `out` (an
    existing `out` is moved aside first and removed once the new one is in place); on any error it is removed and
    `out` is left exactly as it was: a full disk or a kill never leaves a half-written output folder."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        yield stage
        os.chmod(stage, 0o777 & ~_umask())
        old = None
        if out.exists() or out.is_symlink():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        try:
            os.replace(stage, out)
        except BaseException:
            if old is not None:
                os.replace(old, out)
            raise
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _write_text(write: Callable[[IO[str]], None]) -> Callable[[Path], None]:
    def go(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
    return go


def write_json_atomic(path: str | os.PathLike[str], obj: object, *, ensure_ascii: bool = True) -> None:
    """Write `obj` as indented JSON, atomically (`ensure_ascii=False` writes non-ASCII text as UTF-8)."""
    def dump(f: IO[str]) -> None:
        json.dump(obj, f, indent=2, sort_keys=False, ensure_ascii=ensure_ascii)
        f.write("\n")
    replace_atomic(path, _write_text(dump))


def write_jsonl_atomic(path: str | os.PathLike[str], records: Iterable[dict[str, Any]]) -> None:
    """Write one JSON object per line, atomically (parent folders are created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)

    def dump(f: IO[str]) -> None:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    replace_atomic(path, _write_text(dump))


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The JSON object stored in `path`, or None when the file is missing, unreadable, not JSON or not an object
    (for state files a half-finished run may have left behind, where None means "start over")."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_output_path(path: Path, force: bool, flag: str = "--out", example: str = "out.jsonl") -> None:
    """Refuse an output file that is a folder, that exists without `force` (`flag` names the option) or that cannot
    be written (`check_writable_path`)."""
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name such as {path / example}")
    if path.exists() and not force:
        raise FileExistsError(f"{flag} {path} already exists; pass --force to overwrite it")
    check_writable_path(path, flag)


def same_path(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name the same file or folder: a relative path, a symbolic or a hard link."""
    try:
        if os.path.samefile(a, b):  # hard links and symbolic links included
            return True
    except OSError:  # one of them does not exist (yet)
        pass
    return a.resolve() == b.resolve()


def refuse_same_file(out: str | os.PathLike[str], *inputs: tuple[str, str | os.PathLike[str] | None],
                     flag: str = "--out") -> None:
    """Refuse, whatever --force says, an output that is one of the `inputs` ((flag, path) pairs; a None path is
    skipped) under any name: a relative path, a symbolic or a hard link. Writing it would destroy the input."""
    out = Path(out)
    for input_flag, path in inputs:
        if path is not None and same_path(out, Path(path)):
            raise UsageError(f"{flag} {out} is the same file as the input {input_flag} {path}; writing it would "
                             f"destroy the input, so give {flag} another path")


def check_writable_path(path: str | os.PathLike[str], flag: str = "--out") -> None:
    """Refuse, before any work, an output file whose folder cannot be made or written: a path under a file, or a
    folder (the nearest one that exists, when the output's own has yet to be created) without write permission."""
    path = Path(path)
    folder = path.parent
    for above in (folder, *folder.parents):
        if above.exists() or above.is_symlink():
            break
    if not above.is_dir():
        raise UsageError(f"{flag} {path} is a path under {above}, which is a file, not a folder; give {flag} a path "
                         "in a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        what = "folder" if above == folder else f"folder in which {folder} would be created"
        raise UsageError(f"{flag} {path}: the {what}, {above}, is not writable; give {flag} a path in a folder you "
                         "can write to")


def copy_files(src: str | os.PathLike[str], folder: str | os.PathLike[str], *, link: bool = False) -> None:
    """Copy the files of the folder `src` (subfolders included) into `folder`; with `link`, as hard links where the
    file system allows (free, for a folder that is about to replace `src`, whose files are then only ever replaced
    by atomic writes, never written through). A file of the same name in `folder` is unlinked first, never
    overwritten in place: it may be a hard link to a file of a folder that must not change."""
    def put(a: str, b: str) -> None:
        Path(b).unlink(missing_ok=True)
        if link:
            try:
                os.link(a, b)
                return
            except OSError:  # a file system without hard links
                pass
        shutil.copy2(a, b)

    shutil.copytree(src, folder, copy_function=put, dirs_exist_ok=True)
