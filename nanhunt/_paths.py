"""Where nanhunt's own files are: frames from here are ours, never the user's line."""

from __future__ import annotations

import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
