"""``python -m nanhunt``."""

from __future__ import annotations

import sys

try:  # a Ctrl-C while nanhunt itself loads: one line and 130, as later on
    from .cli import entry

    entry()
except KeyboardInterrupt:
    sys.stderr.write("nanhunt: interrupted\n")
    sys.exit(130)
