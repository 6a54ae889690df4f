"""The command line: ``nanhunt diagnose | audit | report | replay`` (:mod:`.main`), its argument
parsing (:mod:`.args`), the script runner (:mod:`.runner`) and the live status line
(:mod:`.live`)."""

from __future__ import annotations

from nanhunt.cli.main import entry, main, split_argv

__all__ = ["entry", "main", "split_argv"]
