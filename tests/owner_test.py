"""The owner layout (acco_jax.dp.owner): assignment by bytes, stacked leaves, slots, round trips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax.dp.flat import FlatLayout
from acco_jax.dp.owner import OwnerLayout


def f32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def check_places(a):
  """Every matrix has its own (owner, group, slot); the owners' bytes add up to the loads."""
  seen, loads = set(), [0] * a.num_shards
  for places, shape, whole in zip(a.places, a.shapes, a.whole, strict=True):
    assert (places is not None) == whole
    for p in places or ():
      assert (p.owner, p.group, p.slot) not in seen and p.slot < a.slots[p.group]
      assert a.groups[p.group] == shape[-2:]
      seen.add((p.owner, p.group, p.slot))
      loads[p.owner] += np.prod(shape[-2:]) * 4
  assert tuple(loads) == tuple(a.loads)


def test_a_stacked_leaf_is_that_many_matrices():
  a = OwnerLayout({"blocks": f32(8, 16, 32), "b": f32(32)}, 8, whole=lambda x: x.ndim > 2)
  assert a.places[0] is None  # the vector stays elementwise (leaves sorted: b, blocks)
  assert [p.owner for p in a.places[1]] == list(range(8))  # one block's matrix per device
  assert a.loads == [16 * 32 * 4] * 8 and a.slot_size == 16 * 32 and a.padding == 0
  assert a.shard_size == 16 * 32 + 4
  check_places(a)


def test_extra_matrices_go_to_the_least_loaded():
  # on 2 devices: the 4x64 matrix to device 0, then three 2x64: one each and the third to device 1
  a = OwnerLayout([f32(4, 64), f32(2, 64), f32(2, 64), f32(2, 64)], 2)
  assert a.loads == [6 * 64 * 4, 4 * 64 * 4]
  assert [p[0].owner for p in a.places] == [0, 0, 1, 1]
  assert a.slots == [1, 2] and a.padding == 4 * 64 + 2 * 64  # one empty slot per group
  check_places(a)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [1, 3, 8])
def test_owners_are_balanced_within_one_largest_matrix(seed, n):
  rng = np.random.default_rng(seed)
  tree = [f32(*rng.integers(1, 4, 3 if rng.random() < 0.3 else 2) * 8) for _ in range(30)]
  tree += [f32(int(d)) for d in rng.integers(1, 100, 5)]
  a = OwnerLayout(tree, n)
  largest = max(np.prod(s) for s in a.groups) * 4
  assert max(a.loads) - min(a.loads) <= largest
  assert sum(a.loads) == a.owned_elements * 4
  assert a.padding <= (n - 1) * sum(np.prod(s) for s in a.groups)
  check_places(a)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_round_trips_are_exact(n):
  shapes = {"e": f32(5, 7), "w": f32(3, 4, 6), "v": f32(6, 4), "b": f32(9), "u": f32(4, 6)}
  keys = jax.random.split(jax.random.key(0), len(shapes))
  tree = {
    k: jax.random.normal(key, s.shape) for key, (k, s) in zip(keys, shapes.items(), strict=True)
  }
  a = OwnerLayout(tree, n)
  shards = a.to_shards(tree)
  assert all(x.shape[0] == n for x in jax.tree.leaves(shards))
  rows = a.shards_to_rows(shards)
  assert rows.shape == (n, a.shard_size) and a.padded_size == n * a.shard_size
  back = a.unravel(a.ravel(tree))
  jax.tree.map(np.testing.assert_array_equal, back, tree)
  jax.tree.map(np.testing.assert_array_equal, a.rows_to_shards(rows), shards)
  # each device's row holds the matrices it owns (and zeros in its empty slots)
  for i, places in enumerate(a.places):
    for j, p in enumerate(places or ()):
      got = shards["owned"][sum(a.slots[: p.group]) + p.slot][p.owner]
      np.testing.assert_array_equal(got, jax.tree.leaves(tree)[i].reshape(-1, *got.shape)[j])
  total = sum(float(jnp.abs(x).sum()) for x in jax.tree.leaves(tree))
  assert float(jnp.abs(rows).sum()) == pytest.approx(total, rel=1e-5)  # padding and slots are zeros


def test_whole_mask_keeps_leaves_elementwise():
  tree = {"wte": f32(100, 8), "w": f32(8, 8)}
  a = OwnerLayout(tree, 4, whole={"wte": False, "w": True})
  assert a.places[1] is None and len(a.places[0]) == 1  # leaves sorted: w, wte
  assert a.shard_size == 64 + FlatLayout([tree["wte"]], 4).shard_size


def test_vectors_and_matrices_are_owned_whole_by_default():
  a = OwnerLayout({"b": f32(7), "c": f32(7), "w": f32(3, 5), "s": f32()}, 2)
  assert all(p is not None for p in a.places) and a.groups == [(3, 5), (7,), ()]
  assert sorted(p[0].owner for p in a.places[:2]) == [0, 1]  # the two vectors on two devices
  assert a.slots == [1, 1, 1] and a.padding == 15 + 1
  check_places(a)


def test_gpt2_wire_row_against_the_elementwise_layout():
  """gpt2 on 8 devices, blocks' matrices owned: 12 of each shape leave 4 empty slots per shape."""
  from acco_jax import model

  shapes = jax.eval_shape(lambda: model.init_params(model.get_config("gpt2"), 0))
  whole = {**jax.tree.map(lambda x: x.ndim >= 2, shapes), "wte": False, "wpe": False}
  a = OwnerLayout(shapes, 8, whole=whole)
  assert a.slots == [2, 2, 2, 2] and max(a.loads) - min(a.loads) <= 4 * 768 * 3072 * 4
  d = 768
  assert a.padding == 4 * (d * d + 3 * d * d + 4 * d * d + 4 * d * d)
  flat = FlatLayout(shapes, 8).shard_size
  assert 1.2 < a.shard_size / flat < 1.25
