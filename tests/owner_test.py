"""The owner assignment of whole matrices (acco_jax.dp.owner): balance, stacking, slots."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax.dp.flat import FlatLayout
from acco_jax.dp.owner import assign_owners


def f32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def check_slots(a):
  """Every matrix has one owner and its own span of the owner's slot; the spans fill the slots."""
  spans = {d: [] for d in range(a.num_devices)}
  for leaf_places, size in zip(a.places, a.matrix_sizes, strict=True):
    for place in leaf_places or ():
      spans[place.owner].append((place.offset, place.offset + size))
  for d, s in spans.items():
    s.sort()
    assert all(end <= start for (_, end), (start, _) in zip(s, s[1:], strict=False)), d
    assert sum(e - b for b, e in s) * 4 == a.loads[d]
    assert not s or s[-1][1] <= a.slot
  assert a.slot == max(a.loads) // 4


def test_a_stacked_leaf_is_that_many_matrices():
  a = assign_owners({"blocks": f32(8, 16, 32), "b": f32(32)}, 8)
  assert a.places[0] is None  # the vector stays elementwise (leaves sorted: b, blocks)
  assert [p.owner for p in a.places[1]] == list(range(8))  # one block's matrix per device
  assert a.loads == (16 * 32 * 4,) * 8 and a.slot == 16 * 32 and a.padding == 0
  assert a.elementwise_row == 4
  check_slots(a)


def test_greedy_by_bytes_puts_the_large_first():
  # sizes 1, 1, 2 (x 64 elements) on two devices: 2 each (in tree order: 3 and 1)
  a = assign_owners([f32(1, 64), f32(1, 64), f32(2, 64)], 2)
  assert a.loads == (2 * 64 * 4,) * 2
  assert [p[0].owner for p in a.places] == [1, 1, 0]
  check_slots(a)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [1, 3, 8])
def test_owners_are_balanced_within_one_largest_matrix(seed, n):
  rng = np.random.default_rng(seed)
  tree = [f32(*rng.integers(1, 5, 3 if rng.random() < 0.3 else 2) * 8) for _ in range(20)]
  tree += [f32(int(d)) for d in rng.integers(1, 100, 5)]
  a = assign_owners(tree, n)
  largest = max(m for m in a.matrix_sizes) * 4
  assert max(a.loads) - min(a.loads) <= largest
  assert sum(a.loads) == sum(np.prod(x.shape) * 4 for x in tree if len(x.shape) >= 2)
  assert a.padding < n * largest // 4 + 1
  check_slots(a)


def test_whole_mask_keeps_leaves_elementwise():
  tree = {"wte": f32(100, 8), "w": f32(8, 8)}
  a = assign_owners(tree, 4, whole={"wte": False, "w": True})
  assert a.places[1] is None and len(a.places[0]) == 1  # leaves sorted: w, wte
  assert a.elementwise_row == FlatLayout({"wte": tree["wte"]}, 4).shard_size
  assert a.row == 64 + a.elementwise_row
  with pytest.raises(ValueError, match="marked whole but is not a matrix"):
    assign_owners([f32(8)], 2, whole=lambda x: True)


def test_gpt2_wire_row_against_the_elementwise_layout():
  """The owners' padding is small when the token embedding stays elementwise, large when owned."""
  from acco_jax import model

  shapes = jax.eval_shape(lambda: model.init_params(model.get_config("gpt2"), 0))
  flat = FlatLayout(shapes, 8).shard_size
  blocks_only = assign_owners(shapes, 8, whole={**jax.tree.map(lambda x: x.ndim >= 2, shapes),
                                                "wte": False, "wpe": False})  # fmt: skip
  assert blocks_only.row / flat < 1.02
  everything = assign_owners(shapes, 8)
  assert everything.row / flat > 2  # the 50257 x 768 embedding owned whole dominates one slot
