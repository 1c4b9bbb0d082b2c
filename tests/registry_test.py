"""Families declare, the shell asks (issue 70, item 1): no module of acco_jax/run names a family
or a method as a value; what it once decided by those names (the data.packing a run needs, whether
a checkpoint's state starts another run kind or reads back on another device count, whether slow
workers are absorbed) is a declared field of each family's :class:`acco_jax.family_api.Family`.
"""

import ast
import pathlib

import pytest

from acco_jax import errors, families
from acco_jax.run import build, health, registry
from configs import gpt2_acco, gpt2_diloco, gpt2_pipeline, gpt2_skippipe, gpt2_zero1

ROOT = pathlib.Path(__file__).resolve().parents[1]


def named_values(source: str, names: set[str]) -> list[tuple[int, str]]:
  """(line, value) of every string constant of ``source`` equal to one of ``names``, docstrings
  aside."""
  tree = ast.parse(source)
  docs = {
    id(node.body[0].value)
    for node in ast.walk(tree)
    if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
    and node.body
    and isinstance(node.body[0], ast.Expr)
    and isinstance(node.body[0].value, ast.Constant)
  }
  return [
    (node.lineno, node.value)
    for node in ast.walk(tree)
    if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs
  ]


def test_the_run_shell_names_no_family_or_method_as_a_value():
  names = set(registry.methods()) | {family.name for family in families.FAMILIES}
  assert {"acco", "diloco", "pipeline", "hdee", "dp", "loco", "ensemble"} <= names
  found = {
    str(path.relative_to(ROOT)): hits
    for path in sorted((ROOT / "acco_jax" / "run").rglob("*.py"))
    if (hits := named_values(path.read_text(), names))
  }
  assert found == {}
  # what the shell had: a branch on a family's name, a method compared by string
  old = 'def f(config, family):\n  """On "loco"."""\n  return family.name == "loco" or config.method == "acco"\n'
  assert named_values(old, names) == [(3, "loco"), (3, "acco")]


def _tiny(module, **overrides):
  config = module.get_config("tiny")
  for key, value in overrides.items():
    group, _, field = key.rpartition(".")
    config[group][field] = value
  return config


def test_each_family_declares_its_packing_rule():
  rule = lambda config: registry.lookup(config.method).packing(config)
  assert rule(_tiny(gpt2_acco)) is None and rule(_tiny(gpt2_zero1)) is None
  assert rule(_tiny(gpt2_skippipe)).required is False  # dp with SkipPipe's paths
  assert rule(_tiny(gpt2_pipeline)).required is False
  assert rule(_tiny(gpt2_diloco)).required is True


def test_the_shell_refuses_by_the_declared_packing_rule():
  """Instruction data (refused before the file is read or anything is built)."""
  rows = {"data.source": "jsonl:/nowhere.jsonl", "data.format": "prompt_completion"}
  with pytest.raises(errors.UserValueError, match=r"^data.packing=False: a LoCo call takes"):
    build.build(_tiny(gpt2_diloco, **rows, **{"data.packing": False}), check_only=True)
  with pytest.raises(errors.UserValueError, match=r"^data.packing=True: SkipPipe's paths"):
    build.build(_tiny(gpt2_skippipe, **rows, **{"data.packing": True}), check_only=True)


def test_each_family_declares_its_checkpoints_and_slow_workers():
  loco, dp = registry.lookup("diloco"), registry.lookup("acco")
  assert loco.state_stays and not loco.reads_any_device_count
  others = [f for f in families.FAMILIES if f.name != "loco"]
  assert all(not f.state_stays and f.reads_any_device_count for f in others)
  acco = _tiny(gpt2_acco, **{"hetero.adaptive": "balance"})
  assert dp.absorbs_slow_workers(acco) and health.on_slow(acco) == "keep"
  assert not dp.absorbs_slow_workers(_tiny(gpt2_zero1, **{"hetero.adaptive": "balance"}))
  assert not loco.absorbs_slow_workers(_tiny(gpt2_diloco))
