"""``python -m fastckpt.cli ...``: same as ``fastckpt ...``."""

from __future__ import annotations

import sys

from fastckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
