"""Framework callbacks: nanhunt inside a Lightning or Hugging Face Trainer run.

``from nanhunt.integrations.lightning import NanhuntCallback`` and
``from nanhunt.integrations.transformers import NanhuntCallback``; each module imports its
framework, so importing this package (or nanhunt) imports neither. A missing framework gives
one line naming the extra to install: ``pip install "nanhunt[lightning]"``.
"""

from __future__ import annotations

__all__: list[str] = []
