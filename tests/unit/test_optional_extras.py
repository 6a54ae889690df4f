"""The integrations are optional: importing nanhunt imports none of them, and a missing one is
one line that names the extra to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# a meta-path finder that makes the named top-level packages look uninstalled
_BLOCK = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Block())
"""


def _python(code: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    prelude = f"BLOCKED = {set(blocked)!r}\n" + _BLOCK if blocked else ""
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def test_importing_nanhunt_imports_no_framework():
    out = _python("""
        import sys, nanhunt, nanhunt.integrations, nanhunt.report, nanhunt.cli.main
        print(sorted(m for m in ("lightning", "pytorch_lightning", "transformers", "accelerate",
                                 "tensorboard") if m in sys.modules))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("module", "package", "extra"), [
    ("nanhunt.integrations.lightning", "lightning", "lightning"),
    ("nanhunt.integrations.transformers", "transformers", "transformers"),
])
def test_missing_framework_names_the_extra(module, package, extra):
    out = _python(f"""
        from nanhunt.errors import NanhuntError
        try:
            import {module}
        except NanhuntError as exc:
            print(exc)
    """, blocked=(package,))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f'{module} needs the {package} package: '
                                  f'pip install "nanhunt[{extra}]"')


def test_missing_tensorboard_is_one_cli_line(tmp_path):
    from nanhunt.trace import Trace

    report = tmp_path / "report.json"
    report.write_text(Trace().to_json())
    out = _python(f"""
        import sys
        from nanhunt.cli.main import main
        sys.exit(main(["report", {str(report)!r}, "--tensorboard", {str(tmp_path / "tb")!r}]))
    """, blocked=("tensorboard",))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        'nanhunt: the TensorBoard export needs the tensorboard package: '
        'pip install "nanhunt[tensorboard]"']
