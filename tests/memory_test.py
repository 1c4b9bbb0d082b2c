"""The predicted peak memory (acco_jax/run/memory.py, issue 68, item 5): a run that cannot fit the
machine is refused in one line before any work (the workdir never created); ``mesh.fit_memory``
halves the simulated devices until the prediction fits; a small run's prediction is within a
factor of its measured peak resident memory (the operating system's count, an independent
reference)."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax.run import build, memory, trainer
from configs import gpt2_acco
from tests import refusals_test

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(tmp_path, **overrides):
  c = gpt2_acco.get_config("tiny")
  c.data.cache_dir = str(tmp_path / "cache")
  c.ckpt.async_save = False
  for key, value in overrides.items():
    group, _, field = key.rpartition(".")
    c[group][field] = value
  return c


def test_state_bytes_counts_each_devices_shard():
  """Hand-counted: a replicated (100,) float32 on 8 devices is 400 bytes on each, 3,200 in all; a
  (64, 2) bfloat16 split over the 8 is 32 bytes on each, 256 in all."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  state = {
    "replicated": jax.ShapeDtypeStruct((100,), np.float32, sharding=NamedSharding(mesh, P())),
    "split": jax.ShapeDtypeStruct(
      (64, 2), jax.numpy.bfloat16, sharding=NamedSharding(mesh, P("data"))
    ),
  }
  assert memory.state_bytes(state) == (400 + 32, 8 * (400 + 32))


def test_a_run_that_cannot_fit_is_refused_before_any_write(tmp_path, monkeypatch):
  """A machine of 0.1 GB: refused in one line naming the fix, the workdir never created."""
  monkeypatch.setattr(memory, "host_memory_bytes", lambda: 0.1e9)
  message = refusals_test.refused_before_any_write(
    tiny(tmp_path), r"GB of host memory at its peak and this machine has 0.1 GB", tmp_path
  )
  assert "--config.mesh.cpu_devices" in message and "train.memory_check=False" in message


def test_memory_check_false_prints_and_does_not_refuse(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(memory, "host_memory_bytes", lambda: 0.1e9)
  config = tiny(tmp_path, **{"train.memory_check": False})
  run = build.build(config, check_only=True)
  p = memory.check_run(run, config)
  assert p.host > 0.1e9
  assert re.search(r"memory \(predicted\): [\d.]+ GB per device", capsys.readouterr().out)


def test_fit_memory_halves_the_devices_until_the_prediction_fits(tmp_path):
  """With the 8-device prediction above 80% of the machine and the 2-device one below, 2 are
  used (and mesh.num_devices says so); off, nothing changes."""
  config = tiny(tmp_path, **{"mesh.fit_memory": True})
  checked = lambda c: build.build(c, check_only=True)
  host = lambda n: _predicted(tiny(tmp_path, **{"mesh.num_devices": n})).host
  between = (host(2) + host(4)) / 2 / memory.FIT_FRACTION
  assert memory.fit_devices(config, checked, host_total=between) == 2
  assert config.mesh.num_devices == 2
  off = tiny(tmp_path)
  assert memory.fit_devices(off, checked, host_total=1.0) is None
  assert off.mesh.num_devices == 0


def _predicted(config):
  run = build.build(config, check_only=True)
  abstract = run.step.abstract_state(run.params_shapes)
  return memory.predict(config, run.model_cfg, abstract, run.params_shapes, run.mesh.size, True)


@pytest.mark.slow
def test_prediction_is_within_a_factor_of_two_of_the_measured_peak(tmp_path):
  """train.py on the tiny preset in a child process: its peak resident memory (the kernel's
  ru_maxrss of the child) against the host peak the run printed before any work."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  out = subprocess.run(
    [
      sys.executable,
      "train.py",
      "--config",
      "configs/gpt2_acco.py:tiny",
      "--workdir",
      str(tmp_path / "run"),
      f"--config.data.cache_dir={tmp_path / 'cache'}",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  measured = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
  assert measured > before * 1024, "no child was measured"
  predicted = float(re.search(r"host peak ([\d.]+) GB", out).group(1)) * 1e9
  assert measured / 2 <= predicted <= 2 * measured, (predicted, measured)


def test_trainer_calls_the_check(tmp_path, monkeypatch):
  """The trainer's check runs before the state is built (a spy that refuses)."""
  calls = []

  def spy(run, config, lead=True):
    calls.append(run.mesh.size)
    raise memory.errors.UserValueError("spy")

  monkeypatch.setattr(memory, "check_run", spy)
  refusals_test.refused_before_any_write(tiny(tmp_path), "spy", tmp_path)
  assert calls == [8]
  assert trainer.memory_lib is memory
