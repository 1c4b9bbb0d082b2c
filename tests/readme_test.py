"""The README's library example runs as written, on the tiny GPT-2 and 8 simulated devices."""

import pathlib
import re

import jax
import numpy as np
import optax
import pytest

from acco_jax import model

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def library_example() -> str:
  text = README.read_text()
  m = re.search(r"As a library:\s*```python\n(.*?)```", text, re.S)
  assert m, "README has no 'As a library:' python block"
  return m.group(1)


def test_readme_library_example_runs_as_written():
  # What the example leaves to the reader: a loss, its parameters, a mesh, a schedule, a mask and
  # data. The example itself runs unchanged.
  cfg = model.get_config("tiny", dtype="float32", L=16)
  params = model.init_params(cfg, 0)
  n, k, rows = len(jax.devices()), 4, 2
  r = np.random.default_rng(0)

  def rows_of(count):
    tokens = r.integers(0, cfg.V, size=(count, cfg.L + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

  scope = {
    "loss_fn": lambda p, mb: model.loss_fn(p, cfg, mb)[0],
    "params": params,
    "mesh": jax.make_mesh((n,), ("data",)),
    "schedule": optax.linear_schedule(1e-3, 1e-4, 10),
    "decay_mask": model.decay_mask(params),
    "first_microbatch": rows_of(n * rows),
    "batch": rows_of(n * k * rows),
  }
  exec(compile(library_example(), str(README), "exec"), scope)
  theta, metrics = scope["theta"], scope["metrics"]
  assert jax.tree.structure(theta) == jax.tree.structure(params)
  assert np.isfinite(float(np.mean(metrics["loss"])))


@pytest.mark.slow  # ~20 s: the second README example (the first runs in the default run)
def test_readme_muon_example_runs_as_written():
  """The second block: Muon through the public API with its defaults (the owner layout chosen by
  ``layout='auto'``, optax's global clip first)."""
  text = README.read_text()
  m = re.search(r"stays global:\s*```python\n(.*?)```", text, re.S)
  assert m, "README has no Muon example after 'stays global:'"
  cfg = model.get_config("tiny", dtype="float32", L=16)
  params = model.init_params(cfg, 0)
  n, k, rows = len(jax.devices()), 4, 2
  r = np.random.default_rng(0)
  tokens = lambda count: r.integers(0, cfg.V, size=(count, cfg.L + 1), dtype=np.int32)
  rows_of = lambda t: {"inputs": t[:, :-1], "targets": t[:, 1:]}
  import acco_jax

  scope = {
    "acco_jax": acco_jax,
    "optax": optax,
    "loss_fn": lambda p, mb: model.loss_fn(p, cfg, mb)[0],
    "params": params,
    "mesh": jax.make_mesh((n,), ("data",)),
    "first_microbatch": rows_of(tokens(n * rows)),
    "batch": rows_of(tokens(n * k * rows)),
  }
  exec(compile(m.group(1), str(README), "exec"), scope)
  assert scope["train"].owner and np.isfinite(float(np.mean(scope["metrics"]["loss"])))
