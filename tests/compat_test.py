"""docs/compositions.md is what the code does: ``python -m bench.run.compat`` builds every combination again
(a few minutes: marked slow, run by .ci/run) and the page must come out the same, every refusal one
line. The table's shape is checked by default."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
from bench.run import compat  # noqa: E402


def test_the_page_has_a_cell_per_combination():
  text = compat.OUT.read_text()
  for title, rows in compat.TABLES.items():
    assert f"## {title}" in text
    for row in rows:
      line = next(x for x in text.splitlines() if x.startswith(f"| {compat.label_of(row)} |"))
      cells = [c.strip() for c in line.strip("|").split("|")[1:]]
      assert len(cells) == len(compat.OPTIMIZERS), line
      assert all(c.startswith(("runs", "no (")) for c in cells), line
  assert "runs · `loco_acco_test`" in text  # ACCO inside the workers is in the table
  assert f"## {compat.ARCH_TABLE}" in text
  for row in compat.ARCH_ROWS:
    line = next(x for x in text.splitlines() if x.startswith(f"| {compat.label_of(row)} |"))
    cells = [c.strip() for c in line.strip("|").split("|")[1:]]
    assert len(cells) == len(compat.ARCHS), line
    assert all(c.startswith("runs") for c in cells[1:]), line  # every family, every architecture
  for _, name in compat.COVERAGE:  # a cell names a test file that exists
    assert (REPO / "tests" / f"{name}.py").is_file(), name


@pytest.mark.slow
def test_the_page_is_current_and_every_refusal_is_one_line():
  from acco_jax import parallel

  parallel.configure_platform(cpu_devices=8)
  results = compat.collect()
  refusals = [
    t for rows in results.values() for by in rows.values() for t, _ in by.values() if t != "runs"
  ]
  assert refusals and all("\n" not in t for t in refusals), [t for t in refusals if "\n" in t]
  # every refusal comes from the check before any data is prepared (build(check_only=True))
  assert all(t.startswith("error: ") for t in refusals), [t for t in refusals if "late" in t]
  assert compat.render_all(results) == compat.OUT.read_text(), "run python -m bench.run.compat"
