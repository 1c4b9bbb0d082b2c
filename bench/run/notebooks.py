"""Executes the notebooks in ``notebooks/`` top to bottom, so they are committed with their outputs.

The notebooks only read ``bench/results/*.json`` and plot, so this takes seconds. By default each
notebook is rewritten in place with its outputs (the figures appear inline and are also saved to
``docs/figures/``)::

  python -m bench.run.notebooks                       # every notebook, in place
  python -m bench.run.notebooks --out /tmp/nb         # executed copies elsewhere; figures there too

A cell that raises makes the command fail (exit 1) and names the notebook; needs
``pip install -e ".[test]"`` (nbclient, ipykernel, matplotlib).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"


def execute(path: Path, out: Path, timeout: int = 600) -> None:
  """Runs ``path`` with the current Python's kernel (cwd = notebooks/) and writes it to ``out``."""
  import nbclient
  import nbformat

  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
  )
  client.execute()
  nbformat.write(nb, out)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("notebooks", nargs="*", help="default: every notebooks/*.ipynb")
  ap.add_argument("--out", help="write executed copies (and figures) here instead of in place")
  args = ap.parse_args(argv)
  paths = [Path(p) for p in args.notebooks] or sorted(NOTEBOOKS.glob("*.ipynb"))
  if args.out:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["ACCO_FIGURES_DIR"] = str(out_dir)  # the kernel inherits it
  for path in paths:
    out = out_dir / path.name if args.out else path
    try:
      execute(path, out)
    except Exception as e:  # nbclient's CellExecutionError carries the cell and the traceback
      print(f"{path.name}: failed\n{e}", file=sys.stderr)
      return 1
    print(f"{path.name}: executed -> {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
