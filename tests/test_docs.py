"""Every snippet in README.md and docs/*.md runs as it is written.

Python blocks of a page run in order in one fresh process; shell blocks run one by one with bash; TOML
blocks must parse. A block that cannot run in a test (it trains for minutes, or needs `make`) is marked on
the line before it with ``<!-- not run: the reason -->``; the reason is required.
"""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(
    r"(?:<!--\s*not run:(?P<reason>[^>]*)-->\s*\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)```", re.S
)
SHELL = ("bash", "sh", "shell")


def blocks(page, lang):
    found = []
    for m in BLOCK.finditer(page.read_text(encoding="utf-8")):
        if m["lang"] in lang:
            if m["reason"] is not None and not m["reason"].strip():
                pytest.fail(f"{page.name}: a `not run` mark needs a reason")
            found.append((m["code"], m["reason"]))
    return found


FILE = re.compile(r"# (\S+\.py)\n")


@pytest.fixture
def workdir(tmp_path):
    """A scratch working directory that sees the repository's examples and docs."""
    for name in ("examples", "docs"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def write_files(page, workdir):
    """The files a page's snippets define: a Python block whose first line is ``# name.py``."""
    for code, _ in blocks(page, ("python",)):
        if m := FILE.match(code):
            (workdir / m[1]).write_text(code)


def environment():
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # fmt: skip


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, ("python",))], ids=lambda p: p.name)
def test_python_snippets_run_in_order(page, workdir):
    write_files(page, workdir)
    code = [c for c, reason in blocks(page, ("python",)) if reason is None]
    script = workdir / "snippets.py"
    script.write_text("\n\n".join(code))
    result = subprocess.run([sys.executable, str(script)], cwd=workdir, capture_output=True, text=True,
                            timeout=900, env=environment())  # fmt: skip
    assert result.returncode == 0, f"{page.name}:\n{result.stderr[-3000:]}"


@pytest.mark.parametrize(
    ("page", "index"),
    [(p, i) for p in PAGES for i, (_, reason) in enumerate(blocks(p, SHELL)) if reason is None],
    ids=lambda x: x.name if isinstance(x, Path) else str(x),
)
def test_shell_snippets_run(page, index, workdir):
    write_files(page, workdir)
    code = [c for c, _ in blocks(page, SHELL)][index]
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=workdir, capture_output=True,
                            text=True, timeout=900, env=environment())  # fmt: skip
    assert result.returncode == 0, f"{page.name} shell block {index}:\n{code}\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, ("toml",))], ids=lambda p: p.name)
def test_toml_snippets_parse(page):
    for code, _ in blocks(page, ("toml",)):
        tomllib.loads(code)


def test_readme_example_is_ten_lines():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Ten lines\n\n```python\n(.*?)```", readme, flags=re.S).group(1)
    assert len([line for line in block.splitlines() if line.strip()]) <= 10  # blank lines not counted
