"""Optional packages (the integrations' extras), imported only when a feature needs them."""

from __future__ import annotations

import importlib
from types import ModuleType

from nanhunt.errors import NanhuntError

__all__ = ["EXTRAS", "require"]

#: import name -> (extra, what needs it): ``pip install "nanhunt[extra]"`` installs it
EXTRAS = {
    "lightning": ("lightning", "nanhunt.integrations.lightning"),
    "transformers": ("transformers", "nanhunt.integrations.transformers"),
    "tensorboard": ("tensorboard", "the TensorBoard export"),
}


def require(name: str) -> ModuleType:
    """Import an optional package, or raise one line that names the extra to install."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        top = name.split(".")[0]
        extra, feature = EXTRAS.get(top, (top, name))
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the package is there but one of its own imports failed: show that
        raise NanhuntError(
            f"{feature} needs the {top} package: pip install \"nanhunt[{extra}]\""
        ) from None
