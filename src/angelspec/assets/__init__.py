"""Files that ship inside the package: the embedded default target (`assets/target/`)."""

from pathlib import Path

DEFAULT_TARGET = Path(__file__).parent / "target"
