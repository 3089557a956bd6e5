"""`python -m angelspec.cli ...` (also how `torchrun ... -m angelspec.cli train` starts each process)."""

import sys

from angelspec.cli import main

if __name__ == "__main__":
    sys.exit(main())
