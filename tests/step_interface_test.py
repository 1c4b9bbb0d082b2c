"""Every family's step implements the one interface the run shell calls (acco_jax.step_api.Step),
its capabilities (Probed, Portable) are declared by what each class defines, and the run shell
calls a step through that interface only.

The steps are built from the tiny configs with ``build(config, check_only=True)``: no data is
prepared and nothing is compiled.
"""

import ast
import inspect
import pathlib

import pytest

from acco_jax import step_api
from acco_jax.run import build
from configs import gpt2_acco, gpt2_diloco, gpt2_pipeline, gpt2_zero1

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (config module, its step's capabilities beyond Step)
FAMILIES = {
  "dp-acco": (gpt2_acco, {step_api.Probed, step_api.Portable}),
  "dp-zero1": (gpt2_zero1, {step_api.Probed, step_api.Portable}),
  "loco-diloco": (gpt2_diloco, set()),
  "pipeline": (gpt2_pipeline, {step_api.Portable}),
}
CAPABILITIES = (step_api.Probed, step_api.Portable)


def _members(protocol) -> set[str]:
  return {
    name for name in vars(protocol) if not name.startswith("_") and name not in ("mro",)
  } | set(getattr(protocol, "__annotations__", {}))


def _step(name):
  module, _ = FAMILIES[name]
  config = module.get_config("tiny")
  return build.build(config, check_only=True).step


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_step_implements_the_interface(name):
  train = _step(name)
  assert isinstance(train, step_api.Step), sorted(
    m for m in _members(step_api.Step) if not hasattr(train, m)
  )
  for member in _members(step_api.Step) - set(step_api.Step.__annotations__):
    declared = inspect.signature(getattr(step_api.Step, member))
    actual = inspect.signature(getattr(type(train), member))
    assert list(actual.parameters) == list(declared.parameters), (member, actual, declared)
  _, capabilities = FAMILIES[name]
  assert {c for c in CAPABILITIES if isinstance(train, c)} == capabilities
  for missing in set(CAPABILITIES) - capabilities:  # absent from the class, not faked
    assert not any(hasattr(type(train), m) for m in _members(missing)), missing


def test_an_object_without_a_member_is_not_a_step():
  """The check above can fail: an object that lacks one member of the interface is no Step."""
  train = _step("dp-zero1")

  class Lacking:
    pass

  lacking = Lacking()
  for member in _members(step_api.Step) - {"call_stages"}:
    setattr(lacking, member, getattr(train, member))
  assert not isinstance(lacking, step_api.Step)
  lacking.call_stages = train.call_stages
  assert isinstance(lacking, step_api.Step)


# the modules of the run shell (and the checkpoints' record) that hold a step, and the names they
# hold it under
CALLERS = {
  "acco_jax/run/trainer.py": ("step", "self.step", "run.step"),
  "acco_jax/run/start.py": ("step", "run.step"),
  "acco_jax/run/init_from.py": ("step", "found['step']"),
  "acco_jax/run/saved.py": ("found['step']",),
  "acco_jax/run/report.py": ("run.step",),
  "acco_jax/run/monitor.py": ("step",),
  "acco_jax/run/rows.py": ("self.step",),
  "acco_jax/run/metrics.py": ("step",),
  "acco_jax/run/streams.py": ("run.step",),
  "acco_jax/ckpt/meta.py": ("step",),  # what a checkpoint records of the step
}


def _calls(path: pathlib.Path, holders) -> set[str]:
  """The attributes ``path`` reads of an object held under one of ``holders``."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Attribute) and ast.unparse(node.value) in holders:
      out.add(node.attr)
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr"):
      assert not node.args or ast.unparse(node.args[0]) not in holders, (
        f"{path}: {ast.unparse(node)} probes the step instead of calling its interface"
      )
  return out


def test_the_run_shell_calls_steps_through_the_interface_only():
  allowed = _members(step_api.Step).union(*map(_members, CAPABILITIES))
  # what a checkpoint reader (a family's source_step) adds for init_from and the export
  allowed |= {"export_state"}
  for rel, holders in CALLERS.items():
    used = _calls(ROOT / rel, holders)
    assert used, f"{rel}: no call of the step found under {holders}: the test reads the wrong names"
    assert used <= allowed, (
      f"{rel} calls {sorted(used - allowed)}, which no step interface declares"
    )


def test_ring_bytes_counts_a_reduce_scatter_and_an_all_gather():
  """4 devices, 1000 bytes: each half sends 3 of the 4 chunks of 250 bytes (750 + 750)."""
  assert step_api.ring_bytes(1000, 4) == 1500
  assert step_api.ring_bytes(1000, 1) == 0
