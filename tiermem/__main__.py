"""``python -m tiermem``: the same command as the ``tiermem`` console script."""

from __future__ import annotations

import sys

from tiermem.cli import main

if __name__ == "__main__":
    sys.exit(main())
