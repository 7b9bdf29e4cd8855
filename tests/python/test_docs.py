"""docs/PYTORCH.md's example program runs as written."""

import os
import re
import subprocess
import sys


DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "PYTORCH.md")


def example_program():
    with open(DOC) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    programs = [b for b in blocks if b.startswith("# hsbn_local_example.py")]
    assert len(programs) == 1, "docs/PYTORCH.md should hold one hsbn_local_example.py"
    return programs[0]


def test_the_local_example_in_the_docs_runs_as_written(tmp_path):
    script = tmp_path / "hsbn_local_example.py"
    script.write_text(example_program())
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=os.environ,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    out = proc.stdout.decode("utf-8", "replace")
    assert proc.returncode == 0, out
    assert out.rstrip().endswith("ok"), out
    assert len(re.findall(r"^rank \d  loss", out, re.M)) == 4, out
