"""nanhunt's one error type."""

from __future__ import annotations

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_SCRIPT_FAILED",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "NanhuntError",
]

#: what every entry point returns (the CLI's `--help` says what each means)
EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_SCRIPT_FAILED = 0, 1, 2, 3
EXIT_INTERNAL = 4  # nanhunt itself failed (a bug of ours): the report says what was recorded
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + SIGINT, 128 + SIGTERM, as shells report


class NanhuntError(Exception):
    """A problem nanhunt reports to the user in one line; ``exit_code`` is what the CLI returns."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code
