"""``python -m nanhunt.cli.forkserver``: a fork server (:mod:`nanhunt.cli.serving`) whose
children run ``nanhunt ARGV``; re-run verification starts one per slot where no zygote was
forked, and the test suite runs its CLI tests through one."""

from __future__ import annotations

__all__ = ["main"]


def _run(argv: list[str]) -> int:
    from nanhunt.cli.main import rerun

    return rerun(argv)


def main() -> None:
    from nanhunt.cli.serving import serve

    serve(_run)


if __name__ == "__main__":
    main()
