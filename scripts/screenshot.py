"""Screenshot an HTML report with headless chromium.

    python scripts/screenshot.py report.html docs/images/report.png
    python scripts/screenshot.py --example report.html docs/images/report-example.png

``--example`` first writes the built-in example trace (an FP16 overflow in
``encoder.blocks.1.ffn.wo``) to the HTML path. The browser runs offline: the flags below turn off
every background network feature, and the report itself loads nothing.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium_command(
    browser: str, profile: str | Path, html: Path, *, png: Path | None, size: tuple[int, int]
) -> list[str]:
    """The chromium command line that screenshots (``png``) or dumps the DOM of ``html``."""
    cmd = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
    if png is not None:
        cmd += [f"--screenshot={png}", f"--window-size={size[0]},{size[1]}"]
    else:
        cmd += ["--dump-dom", "--virtual-time-budget=2000"]
    return [*cmd, html.resolve().as_uri()]


def screenshot(
    html: Path, png: Path, *, size: tuple[int, int] = (1280, 2000), timeout: float = 90
) -> Path:
    browser = find_chromium()
    if browser is None:
        raise SystemExit("screenshot: chromium not found (apt-get install chromium)")
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nanhunt-chromium-") as profile:
        cmd = chromium_command(browser, profile, html, png=png.resolve(), size=size)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 or not png.exists():
        raise SystemExit(f"screenshot: chromium failed ({proc.returncode}): {proc.stderr[-500:]}")
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html", type=Path, help="the report.html to screenshot")
    parser.add_argument("png", type=Path, help="where to write the PNG")
    parser.add_argument("--example", action="store_true", help="write the example report first")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.example:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from nanhunt.report import render_html
        from nanhunt.report._example import example_trace
        from nanhunt.report.files import atomic_write_text

        args.html.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.html, render_html(example_trace()))
    if not args.html.is_file():
        parser.error(f"no such file: {args.html}")
    png = screenshot(args.html, args.png, size=(args.width, args.height))
    print(f"{png} ({png.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
