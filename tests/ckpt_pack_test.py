"""Checkpoint packing: which leaves share an array, that packing moves nothing between devices, and
that every way a checkpoint is read gives the leaves back bit for bit (packed, alone, version 1)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax.ckpt import checkpoint
from acco_jax.ckpt import pack as ckpt_pack
from acco_jax.ckpt.checkpoint import Checkpointer
from tests.checkpoint_test import abstract, assert_bitwise_equal


def mesh():
  return jax.make_mesh((4, 2), ("replica", "data"), axis_types=(AxisType.Auto,) * 2)


def put(shape, spec, dtype=np.float32, seed=0):
  values = np.random.default_rng(seed).normal(size=shape).astype(dtype)
  return jax.device_put(values, NamedSharding(mesh(), spec))


def state():
  """Leaves of the layouts a train state has (ZeRO-1 rows, LoCo workers' rows, replicated counts),
  one alone in its group and two a group cannot hold (partitioned on a later dimension; blocks
  that are not rows)."""
  return {
    "workers": put((4, 2, 5), P("replica", "data"), seed=1),  # one row per device
    "zero1": put((16, 3), P(("replica", "data")), seed=2),  # two rows of the leaf per device
    "lane": put((6, 2), P("data"), seed=3),  # rows over 'data' only: another group
    "lane_b": put((4, 2), P("data"), seed=4),
    "half": put((8, 3), P(("replica", "data")), jnp.bfloat16, seed=5),  # another dtype
    "half_b": put((8, 2), P(("replica", "data")), jnp.bfloat16, seed=6),
    "count": jax.device_put(jnp.int32(7), NamedSharding(mesh(), P())),
    "step": jax.device_put(jnp.int32(3), NamedSharding(mesh(), P())),
    "scale": put((3,), P(), seed=7),  # alone: the only replicated float32 leaf
    "columns": put((3, 8), P(None, ("replica", "data")), seed=8),  # alone: split on dimension 1
    "blocks": put((8, 2, 2), P("replica", "data"), seed=9),  # alone: a block spans 2 of dim 0
  }


def test_plan_groups_leaves_by_dtype_and_row_axes():
  leaves = jax.tree.leaves(state())  # in sorted key order
  names = sorted(state())
  groups, alone = ckpt_pack.plan(leaves)
  assert [names[i] for i in alone] == ["blocks", "columns", "scale"]
  found = {
    (g.dtype.name, g.rows, tuple(g.sharding.spec)): [names[i] for i, _, _ in g.members]
    for g in groups
  }
  assert found == {
    ("float32", 8, (("replica", "data"),)): ["workers", "zero1"],
    ("float32", 2, ("data",)): ["lane", "lane_b"],
    ("bfloat16", 8, (("replica", "data"),)): ["half", "half_b"],
    ("int32", 1, (None,)): ["count", "step"],
  }
  for g in groups:  # columns side by side, each leaf's size / rows wide
    assert [c for _, c, _ in g.members] == list(np.cumsum([0] + [n for *_, n in g.members])[:-1])
    assert g.width == sum(leaves[i].size // g.rows for i, _, _ in g.members)


def test_a_packed_row_is_its_devices_blocks_and_packing_moves_nothing():
  leaves = jax.tree.leaves(state())
  groups, _ = ckpt_pack.plan(leaves)
  for g in groups:
    packed = ckpt_pack.pack(g, leaves)
    assert packed.shape == (g.rows, g.width) and packed.sharding == g.sharding
    for shard in packed.addressable_shards:
      own = [
        next(s for s in leaves[i].addressable_shards if s.device == shard.device)
        for i, _, _ in g.members
      ]
      expected = np.concatenate([np.asarray(s.data).reshape(-1) for s in own])
      np.testing.assert_array_equal(np.asarray(shard.data).reshape(-1), expected)
    xs = [leaves[i] for i, _, _ in g.members]
    hlo = ckpt_pack._packer(g.rows, g.sharding).lower(xs).compile().as_text()
    moves = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
    assert not [op for op in moves if op in hlo], g


def test_every_read_gives_the_leaves_back(tmp_path):
  s = state()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, s, extra={"k": 1})
    ckpt.wait()
    meta = json.loads((tmp_path / "1" / "meta" / "metadata").read_text())
    stored = {e["pack"][0] if "pack" in e else e["key"] for e in meta["leaves"]}
    assert len(stored) == 7  # four groups and the three leaves stored alone, not eleven arrays
    restored, extra = ckpt.restore(None, abstract(s))  # as saved: unpacked device by device
    assert extra == {"k": 1}
    assert_bitwise_equal(restored, s, s)
    rep = NamedSharding(mesh(), P())  # elsewhere: unpacked on the host, then placed
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), s)
    assert_bitwise_equal(ckpt.restore(1, target)[0], s, target)
    host, _ = ckpt.restore_host(1, lambda extra: s)
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(s), strict=True):
      assert isinstance(a, np.ndarray) and a.shape == b.shape
      np.testing.assert_array_equal(
        a.reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8)
      )


def test_groups_split_at_the_row_cap_and_version_1_still_reads(tmp_path, monkeypatch):
  s = {**state(), **{f"rep{k}": put((3,), P(), seed=10 + k) for k in range(4)}}
  s["wide"] = put((8,), P(), seed=20)  # 32 bytes: over the cap on its own
  monkeypatch.setattr(ckpt_pack, "MAX_ROW_BYTES", 24)  # 6 float32 columns a row
  names = sorted(s)
  groups, alone = ckpt_pack.plan(jax.tree.leaves(s))
  replicated = [[names[i] for i, _, _ in g.members] for g in groups if g.key.endswith("float32")]
  assert replicated == [["rep0", "rep1"], ["rep2", "rep3"]]  # 3 + 3 columns, then a new group
  # a group of one would only copy its leaf: those the cap leaves by themselves are stored alone
  assert {"scale", "wide", "workers", "zero1", "lane", "lane_b"} <= {names[i] for i in alone}
  assert all(g.width * g.dtype.itemsize <= 24 and len(g.members) > 1 for g in groups)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, s, extra={})
    ckpt.wait()
    assert_bitwise_equal(ckpt.restore(1, abstract(s))[0], s, s)
  monkeypatch.undo()
  # version 1: every leaf stored alone under its own key (a checkpoint from before packing)
  monkeypatch.setattr(ckpt_pack, "plan", lambda leaves: ([], list(range(len(leaves)))))
  monkeypatch.setattr(checkpoint, "_VERSION", 1)
  with Checkpointer(tmp_path / "v1") as ckpt:
    ckpt.save(1, s, extra={})
  meta = json.loads((tmp_path / "v1" / "1" / "meta" / "metadata").read_text())
  assert meta["version"] == 1 and not any("pack" in e for e in meta["leaves"])
  monkeypatch.undo()
  with Checkpointer(tmp_path / "v1") as ckpt:
    assert_bitwise_equal(ckpt.restore(1, abstract(s))[0], s, s)


@pytest.mark.parametrize("spec", [P(None, "data"), P("data", None)])
def test_row_axes_of_a_two_dimensional_leaf(spec):
  x = jax.ShapeDtypeStruct((4, 6), jnp.float32, sharding=NamedSharding(mesh(), spec))
  assert ckpt_pack.row_axes(x) == (None if spec[0] is None else (mesh(), ("data",), 2))
