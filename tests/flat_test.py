"""FlatLayout: the shard-major flat buffer and its pytree views."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax.dp.flat import FlatLayout


def tree():
  r = np.random.default_rng(0)
  return {
    "a": r.normal(size=(5, 7)).astype(np.float32),
    "b": {"c": r.normal(size=(3,)).astype(np.float32)},
  }


def test_round_trip_and_sizes():
  t = tree()
  layout = FlatLayout(t, 8)
  assert layout.num_params == 38
  # chunk sizes: ceil(35/8)=5, ceil(3/8)=1 -> S=6, padded 48
  assert layout.shard_size == 6 and layout.padded_size == 48
  flat = layout.ravel(t)
  assert flat.shape == (48,)
  back = layout.unravel(flat)
  for x, y in zip(jax.tree.leaves(t), jax.tree.leaves(back), strict=True):
    np.testing.assert_array_equal(x, np.asarray(y))


def test_row_i_holds_chunk_i_of_every_leaf():
  """The property the reduce-scatter relies on, checked against a hand-built layout."""
  t = tree()
  layout = FlatLayout(t, 8)
  rows = np.asarray(layout.ravel(t)).reshape(8, 6)
  a = np.pad(t["a"].ravel(), (0, 5))  # 40
  c = np.pad(t["b"]["c"].ravel(), (0, 5))  # 8
  for i in range(8):
    np.testing.assert_array_equal(rows[i], np.concatenate([a[5 * i : 5 * i + 5], c[i : i + 1]]))


def test_padding_is_zero_and_shards_view_matches():
  t = tree()
  layout = FlatLayout(t, 8)
  shards = layout.to_shards(t)
  assert shards["a"].shape == (8, 5) and shards["b"]["c"].shape == (8, 1)
  assert float(jnp.abs(shards["a"].reshape(-1)[35:]).sum()) == 0.0
  rows = layout.shards_to_rows(shards)
  np.testing.assert_array_equal(np.asarray(rows).reshape(-1), np.asarray(layout.ravel(t)))
  back = layout.rows_to_shards(rows)
  np.testing.assert_array_equal(np.asarray(back["a"]), np.asarray(shards["a"]))


def test_local_rows_have_leading_one():
  t = tree()
  layout = FlatLayout(t, 8)
  rows = layout.ravel(t).reshape(8, 6)
  local = layout.rows_to_shards(rows[3:4])
  assert local["a"].shape == (1, 5)


def test_dtype_cast_and_structure_errors():
  t = tree()
  layout = FlatLayout(t, 4)
  assert layout.ravel(t, jnp.bfloat16).dtype == jnp.bfloat16
  assert layout.unravel(layout.ravel(t), jnp.bfloat16)["a"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="structure does not match"):
    layout.ravel({"a": t["a"]})
  with pytest.raises(ValueError, match="num_shards must be >= 1"):
    FlatLayout(t, 0)
