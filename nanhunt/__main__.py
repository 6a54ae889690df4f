"""``python -m nanhunt``."""

from __future__ import annotations

import os
import sys

try:  # a Ctrl-C while nanhunt itself loads: one line and 130, as later on
    from nanhunt.cli.main import entry

    entry()
except KeyboardInterrupt:
    sys.stderr.write("nanhunt: interrupted\n")
    sys.stderr.flush()
    os._exit(130)  # nothing of the user's ran: see cli.exit_now
