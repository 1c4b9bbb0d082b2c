"""The persistent compilation cache (acco_jax.run.compile_cache): where it goes, what turns it off,
and, counted by JAX's own monitoring events, that the same config loads its programs from the cache
while a changed config compiles anew."""

from __future__ import annotations

import collections
import os

import jax
import pytest

from acco_jax.run import compile_cache, trainer
from tests.bad_input_test import tiny


@pytest.fixture
def restore_cache_config():
  """The suite's own cache (conftest.py) is back in place after the test."""
  keys = ("jax_enable_compilation_cache", "jax_compilation_cache_dir")
  saved = {k: getattr(jax.config, k) for k in keys}
  yield
  for k, v in saved.items():
    jax.config.update(k, v)
  compile_cache.jax_cache.reset_cache()


@pytest.fixture
def cache_events():
  """Counts of JAX's ``/jax/compilation_cache/*`` events while the test runs."""
  counts = collections.Counter()

  def listen(event, **kwargs):
    if event.startswith("/jax/compilation_cache/"):
      counts[event.rsplit("/", 1)[-1]] += 1

  jax.monitoring.register_event_listener(listen)
  yield counts
  jax.monitoring.unregister_event_listener(listen)


def test_the_directory_is_the_users_cache_per_machine_kind(monkeypatch, tmp_path):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compile_cache.default_dir() == str(tmp_path / "acco_jax" / "xla")
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert compile_cache.default_dir() == os.path.expanduser("~/.cache/acco_jax/xla")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))  # as jax itself reads it
  assert compile_cache.default_dir() == str(tmp_path / "env")
  tag = compile_cache.machine_tag()
  assert tag.startswith("cpu") and "/" not in tag


def test_off_and_unwritable(tmp_path, capfd, restore_cache_config):
  assert compile_cache.configure("") is None
  assert not jax.config.jax_enable_compilation_cache
  blocker = tmp_path / "a-file"
  blocker.write_text("not a directory")
  assert compile_cache.configure(str(blocker / "xla")) is None
  err = capfd.readouterr().err.strip()
  assert err.count("\n") == 0 and err.startswith("warning: compile cache off: cannot write"), err
  assert "--config.compile.cache_dir" in err
  assert not jax.config.jax_enable_compilation_cache
  assert blocker.read_text() == "not a directory"  # nothing written over it
  path = compile_cache.configure(str(tmp_path / "xla"))
  assert path == str(tmp_path / "xla" / compile_cache.machine_tag())
  assert jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir == path
  assert compile_cache.configure(str(tmp_path / "xla")) == path  # again: nothing changes


def test_same_config_hits_and_changed_config_misses(tmp_path, restore_cache_config, cache_events):
  small = {
    "model.D": 16,
    "model.N": 1,
    "model.H": 1,
    "model.dtype": "float32",
    "train.num_updates": 1,
    "opt.warmup_updates": 0,
    "train.eval_every": 0,
    "train.eval_batches": 1,
    "compile.cache_dir": str(tmp_path / "xla"),
  }

  def train(name, **overrides):
    cache_events.clear()
    trainer.train_and_evaluate(tiny(**{**small, **overrides}), str(tmp_path / name))
    return dict(cache_events)

  cold = train("cold")
  assert cold.get("cache_misses", 0) >= 2 and not cold.get("cache_hits"), cold
  entries = os.listdir(jax.config.jax_compilation_cache_dir)
  assert any(e.startswith("jit_stage-") for e in entries), entries  # the training step's program

  again = train("again")  # the run's programs are built anew, as in a new process
  assert again.get("cache_hits", 0) >= 2 and not again.get("cache_misses"), (again, cold)

  other_lr = train("other-lr", **{"opt.lr": 1e-3})  # the step bakes in its schedule
  assert other_lr.get("cache_misses", 0) >= 1, other_lr  # nothing stale is reused
  assert other_lr.get("cache_hits", 0) >= 1, other_lr  # the programs that did not change


def test_the_bound_deletes_the_least_recently_written_entries_once(tmp_path):
  """configure() prunes the directory to its bound, oldest writes first, and leaves JAX's own bound
  off (with it, every entry JAX writes scans the whole directory)."""
  path = tmp_path / compile_cache.machine_tag()
  path.mkdir()
  for i, size in enumerate((300, 200, 100)):  # written oldest first
    (path / f"entry{i}-cache").write_bytes(b"x" * size)
    os.utime(path / f"entry{i}-cache", (1000 + i, 1000 + i))
  keys = ("jax_enable_compilation_cache", "jax_compilation_cache_dir")
  saved = {k: getattr(jax.config, k) for k in keys}
  try:
    assert compile_cache.configure(str(tmp_path), max_bytes=350) == str(path)
    assert jax.config.jax_compilation_cache_max_size == -1
  finally:
    for k, v in saved.items():
      jax.config.update(k, v)
    compile_cache.jax_cache.reset_cache()
  assert sorted(p.name for p in path.iterdir() if not p.name.startswith(".")) == [
    "entry1-cache",
    "entry2-cache",
  ]
  assert compile_cache.prune(str(path), 350) == 0  # within the bound: nothing more goes
