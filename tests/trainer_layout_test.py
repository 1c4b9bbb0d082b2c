"""The trainer's loop on one screen (issue 70, item 3): ``Loop`` sets every attribute it holds in
``__init__`` and holds about a dozen (the rows being written, the clock and progress and the health
watch are parts of their own), and ``trainer.py`` re-exports nothing: tests and benchmarks import
from where things live."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAINER = ROOT / "acco_jax" / "run" / "trainer.py"


def _self_targets(node) -> list[str]:
  targets = node.targets if isinstance(node, ast.Assign) else [node.target]
  flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
  return [
    e.attr
    for e in flat
    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"
  ]


def assigned(source: str, cls: str) -> dict[str, set[str]]:
  """Attribute -> the methods of ``cls`` that assign ``self.<attribute>``."""
  tree = ast.parse(source)
  found = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
  out: dict[str, set[str]] = {}
  for fn in (n for n in found.body if isinstance(n, ast.FunctionDef)):
    for node in ast.walk(fn):
      if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
        for attr in _self_targets(node):
          out.setdefault(attr, set()).add(fn.name)
  return out


def test_the_loop_holds_about_a_dozen_attributes_all_set_in_init():
  found = assigned(TRAINER.read_text(), "Loop")
  assert len(found) <= 12, sorted(found)
  assert {k for k, where in found.items() if "__init__" not in where} == set()
  # the shape it had: attributes first set in begin()
  old = "class Loop:\n  def __init__(self):\n    self.a = 1\n  def begin(self):\n    self.b, self.a = 2, 3\n"
  assert assigned(old, "Loop") == {"a": {"__init__", "begin"}, "b": {"begin"}}


def test_the_trainer_reexports_nothing_and_nothing_imports_through_it():
  tree = ast.parse(TRAINER.read_text())
  reexported = [
    a.name
    for node in tree.body
    if isinstance(node, ast.ImportFrom)
    for a in node.names
    if a.asname == a.name
  ]
  assert reexported == []
  through = re.compile(r"\btrainer\.(build|batch_stream|check_vocab|evaluate|eval_function|Run)\b")
  users = [
    str(path.relative_to(ROOT))
    for folder in ("tests", "bench", "acco_jax")
    for path in (ROOT / folder).rglob("*.py")
    if through.search(path.read_text())
  ]
  assert users == [], "import these from acco_jax.run.build / acco_jax.run.report"
