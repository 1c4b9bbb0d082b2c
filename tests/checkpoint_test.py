"""Checkpointer: sharded round trips, retention, atomicity, corruption fallback and mismatch errors."""

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax.ckpt import settling
from acco_jax.ckpt.checkpoint import Checkpointer
from tests.methods_test import make_batches
from tests.step_test import build

EXTRA = {"data": {"epoch": 1, "position": 123}, "seed": 7, "config": {"lr": 1e-3, "name": "tiny"}}


def abstract(tree):
  """ShapeDtypeStructs of ``tree`` with its shardings."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def assert_bitwise_equal(restored, expected, target):
  """Bit for bit: a restore moves bytes and computes nothing, whatever the CPU."""
  assert jax.tree.structure(restored) == jax.tree.structure(expected)
  leaves = jax.tree.leaves(restored), jax.tree.leaves(expected), jax.tree.leaves(target)
  for r, e, t in zip(*leaves, strict=True):
    assert r.dtype == e.dtype and r.shape == e.shape
    np.testing.assert_array_equal(
      np.asarray(r).reshape(-1).view(np.uint8), np.asarray(e).reshape(-1).view(np.uint8)
    )
    assert r.sharding == t.sharding


def simple_state(seed):
  """A small state with one array large enough to be stored out of line (in a data file)."""
  mesh = jax.make_mesh((8,), ("data",))
  r = np.random.default_rng(seed)
  big = r.normal(size=(8, 20000)).astype(np.float32)
  return {
    "big": jax.device_put(big, NamedSharding(mesh, P("data"))),
    "count": jax.device_put(jnp.int32(seed), NamedSharding(mesh, P())),
    "low": {"bf16": jnp.asarray(big[:, :9], jnp.bfloat16), "mask": jnp.asarray(big[0] > 0)},
    "buf": None,
  }


@pytest.fixture(scope="module")
def states():
  """A trained-for-one-stage state of a delayed method (buf set) and of a synchronous one (None)."""
  out = {}
  for name in ("acco", "zero1"):
    train, state = build(name)
    out[name] = train.step(state, make_batches(1)[0])[0]
  assert out["acco"].buf is not None and out["zero1"].buf is None
  return out


@pytest.mark.parametrize("name", ["acco", "zero1"])
def test_round_trip_is_bitwise_with_target_shardings(tmp_path, states, name):
  state = states[name]
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(5, state, extra=EXTRA)
    ckpt.wait()
    assert ckpt.latest_step() == 5
    # abstract target with the saved shardings
    target = abstract(state)
    restored, extra = ckpt.restore(None, target)
    assert extra == EXTRA
    assert_bitwise_equal(restored, state, target)
    assert (restored.buf is None) == (name == "zero1")
    # concrete target holding other values, every leaf replicated: data from disk, sharding from target
    rep = NamedSharding(jax.make_mesh((8,), ("data",)), P())
    target = jax.tree.map(lambda x: jax.device_put(jnp.zeros(x.shape, x.dtype), rep), state)
    restored, _ = ckpt.restore(5, target)
    assert_bitwise_equal(restored, state, target)


def test_keep_latest_and_async(tmp_path, states):
  state = states["acco"]
  with Checkpointer(tmp_path, keep=2, async_save=True) as ckpt:
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    in_flight = []
    for step in (10, 20, 30):
      ckpt.save(step, state._replace(stage=jnp.int32(step)), extra={"step": step})
      latest, names = ckpt.latest_step(), sorted(os.listdir(tmp_path))  # in this order
      if f"{step}.orbax-checkpoint-tmp" in names:  # still being written: invisible, and nothing
        older = [s for s in (10, 20) if s < step]  # old deleted before it is complete
        assert latest == max(older, default=None)
        assert names == [*map(str, older), f"{step}.orbax-checkpoint-tmp"]
        in_flight.append(step)
    ckpt.wait()
    assert in_flight, "every async save finished before save() returned: nothing was checked"
    assert ckpt.all_steps() == [20, 30] and ckpt.latest_step() == 30
    assert sorted(os.listdir(tmp_path)) == ["20", "30"]
    restored, extra = ckpt.restore(None, abstract(state))
    assert extra == {"step": 30} and int(restored.stage) == 30
    ckpt.save(30, state, extra={"step": "again"})  # the step it saved last: a no-op
    with pytest.raises(ValueError, match="already holds step"):
      ckpt.save(25, state, extra={})
  with Checkpointer(tmp_path, keep=2) as again:  # a new process sees the same steps
    assert again.all_steps() == [20, 30]
    assert again.restore(None, abstract(state))[1] == {"step": 30}
    with pytest.raises(ValueError, match="already holds step"):
      again.save(30, state, extra={})


def largest_data_file(step_dir):
  return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_bytes(path):
  data = bytearray(path.read_bytes())
  for i in range(len(data) // 4, 3 * len(data) // 4, max(1, len(data) // 16)):
    data[i] ^= 0x5A
  path.write_bytes(bytes(data))


CORRUPTIONS = {
  "flip_bytes": lambda d: flip_bytes(largest_data_file(d / "state")),
  "truncate": lambda d: largest_data_file(d / "state").write_bytes(b"\x00" * 10),
  "delete_manifest": lambda d: (d / "state" / "manifest.ocdbt").unlink(),
  "delete_state": lambda d: shutil.rmtree(d / "state"),
  "garble_meta": lambda d: (d / "meta" / "metadata").write_bytes(b"\xff\x00junk{"),
  # well-formed files holding other numbers: only the fingerprint check can notice
  "other_arrays": lambda d: (
    shutil.rmtree(d / "state") or shutil.copytree(d.parent / "1" / "state", d / "state")
  ),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupt_latest_falls_back(tmp_path, caplog, how):
  with Checkpointer(tmp_path, keep=3, async_save=False) as ckpt:
    for step in (1, 2, 3):
      ckpt.save(step, simple_state(step), extra={"step": step})
  CORRUPTIONS[how](tmp_path / "3")
  target = abstract(simple_state(0))
  with Checkpointer(tmp_path, keep=3) as ckpt:
    assert ckpt.latest_step() == 3
    with caplog.at_level(logging.WARNING, logger="acco_jax.ckpt.checkpoint"):
      restored, extra = ckpt.restore(None, target)
    assert extra == {"step": 2}
    assert_bitwise_equal(restored, simple_state(2), target)
    assert any("step 3" in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(RuntimeError, match="step 3 .* is corrupt"):
      ckpt.restore(3, target)
    # resuming from step 2 may write step 3 again: the known-corrupt one is replaced
    ckpt.save(3, simple_state(30), extra={"step": 30})
    ckpt.wait()
    assert ckpt.restore(None, target)[1] == {"step": 30}
  gc.collect()  # a reader left behind would be reported in this test, not a later one


def test_all_corrupt_is_a_clear_error(tmp_path):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    for step in (1, 2):
      ckpt.save(step, simple_state(step), extra={})
  for step in (1, 2):
    flip_bytes(largest_data_file(tmp_path / str(step) / "state"))
  with Checkpointer(tmp_path) as ckpt, pytest.raises(RuntimeError) as info:
    ckpt.restore(None, abstract(simple_state(0)))
  message = str(info.value)
  assert "no readable checkpoint" in message and str(tmp_path) in message and "\n" not in message
  gc.collect()


@pytest.mark.parametrize("settled", [False, True])
def test_settled_loop_ends_the_reads_a_failure_leaves(monkeypatch, settled):
  """What orbax does for a restore (a fresh loop, closed as soon as a gather of reads raises) and
  what it leaves behind: a read still pending, whose coroutine the garbage collector closes, and
  whose ``except BaseException`` (as in orbax's reader) turns that close into an unraisable error.
  Within ``settling.settled_loops`` the loop cancels and awaits that read before it closes."""
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

  async def read(fail: bool):
    try:
      await asyncio.sleep(0 if fail else 60)
      if fail:
        raise OSError("damaged chunk")
    except BaseException as e:
      raise RuntimeError("read failed") from e

  async def restore():
    await asyncio.gather(read(True), read(False))

  def run_sync():
    loop = asyncio.new_event_loop()
    try:
      loop.run_until_complete(restore())
    finally:
      loop.close()

  with settling.settled_loops() if settled else contextlib.nullcontext():
    with pytest.raises(RuntimeError, match="read failed"):
      run_sync()
  gc.collect()
  assert len(unraisable) == (0 if settled else 1), unraisable
  assert not isinstance(asyncio.get_event_loop_policy(), settling.SettlingPolicy)  # restored


def test_failed_restore_leaves_no_reads_behind(tmp_path, monkeypatch, caplog):
  """A restore that fails inside orbax (here every chunk of a truncated file) ends its other reads
  before it raises: none is left for the garbage collector, which could only report it as an
  unraisable exception, and no read's failure is logged as never retrieved."""
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, simple_state(1), extra={})
  largest_data_file(tmp_path / "1" / "state").write_bytes(b"\x00" * 10)
  target = abstract(simple_state(0))
  with Checkpointer(tmp_path) as ckpt:
    for _ in range(8):  # whether a read is still pending when the first one fails is a race
      with pytest.raises(RuntimeError, match="step 1 .* is corrupt"):
        ckpt.restore(1, target)
      gc.collect()
  assert not unraisable, f"{len(unraisable)} unraisable, e.g. {unraisable[0].exc_value!r:.300}"
  assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text[:2000]


def test_mismatched_target_is_a_clear_error(tmp_path, states):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, states["acco"], extra={})
    ckpt.wait()
    other_method = abstract(states["zero1"])  # no buf / buf_count, other optimizer state
    with pytest.raises(ValueError, match="written for a different state") as info:
      ckpt.restore(None, other_method)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)
    bigger = abstract(states["acco"])._replace(w=jax.ShapeDtypeStruct((96,), jnp.float32))
    with pytest.raises(
      ValueError, match=r"\.w is float32\[88\] in the checkpoint but float32\[96\]"
    ):
      ckpt.restore(1, bigger)


def test_killed_save_is_invisible(tmp_path):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, simple_state(1), extra={"step": 1})
  # a save of step 2 killed before orbax's final rename: a complete-looking tmp dir
  shutil.copytree(tmp_path / "1", tmp_path / "2.orbax-checkpoint-tmp")
  target = abstract(simple_state(0))
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    assert ckpt.restore(None, target)[1] == {"step": 1}
    ckpt.save(2, simple_state(2), extra={"step": 2})  # the retry replaces the leftover
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    assert not (tmp_path / "2.orbax-checkpoint-tmp").exists()
    assert ckpt.restore(None, target)[1] == {"step": 2}
