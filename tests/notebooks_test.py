"""Every notebook runs top to bottom on the committed benchmark results, and shows its plots."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_without_error(tmp_path, path):
  proc = subprocess.run(
    [sys.executable, "-m", "bench.run.notebooks", str(path), "--out", str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=900,
    cwd=REPO,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  nb = json.loads((tmp_path / path.name).read_text())
  outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o["output_type"] == "error"]
  assert any("image/png" in o.get("data", {}) for o in outputs), "no plot was shown"


def test_committed_notebooks_hold_their_outputs():
  """The committed files were executed: a reader on a code host sees the plots."""
  for path in NOTEBOOKS:
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in cells), f"{path.name} has unexecuted cells"
    assert any("image/png" in o.get("data", {}) for c in cells for o in c.get("outputs", [])), (
      f"{path.name} was committed without its plots: run python -m bench.run.notebooks"
    )
