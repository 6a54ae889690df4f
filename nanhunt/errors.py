"""nanhunt's one error type."""

from __future__ import annotations

__all__ = ["NanhuntError"]


class NanhuntError(Exception):
    """A problem nanhunt reports to the user in one line; ``exit_code`` is what the CLI returns."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
