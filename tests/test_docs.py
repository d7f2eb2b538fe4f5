"""The snippets in the docs run as they are written."""

import os
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).parents[1] / "docs"


def test_plugin_guide_snippets_run_in_order(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "plugins.md").read_text(), flags=re.S)
    assert len(blocks) >= 6  # one per hook, two for agents
    script = tmp_path / "snippets.py"
    script.write_text("\n".join(blocks))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert result.returncode == 0, result.stderr
    assert (
        "politeness" in result.stdout
        and "Tokyo" in result.stdout
        and "LlamaForCausalLM 49152" in result.stdout
        and "reward 0." in result.stdout
    )


def test_readme_ten_lines_run(tmp_path):
    readme = (DOCS.parent / "README.md").read_text()
    block = re.search(r"## Ten lines\n\n```python\n(.*?)```", readme, flags=re.S).group(1)
    assert len(block.strip().splitlines()) <= 12
    result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "sentiment" in result.stdout
