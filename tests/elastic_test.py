"""Elastic restore: a state saved on 8 devices restores on 4 and 2 devices and back, and trains on.

The logical (per-parameter, unpadded) view of each state is computed here with plain numpy from the
parameter shapes alone (no FlatLayout), so a conversion that moves or drops a real element, or keeps
a stale padding, shows up as a mismatch.
"""

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acco_jax
from acco_jax import data
from acco_jax.ckpt import fingerprint
from acco_jax.ckpt.checkpoint import Checkpointer
from tests.methods_test import B, K, N, as_f32, first_microbatch, init_params, loss_fn, make_batches

PARAMS = as_f32(init_params())
ROWS = N * K * B  # one global batch (48 rows): k = ROWS / (n * B) microbatches on n devices


def build(name, n, params=PARAMS):
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  tx = acco_jax.get_method(name, inner, comm_dtype=jnp.float32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
  return acco_jax.make_train_step(
    loss_fn, tx, mesh, num_microbatches=ROWS // (n * B), params=params
  )


# -- an independent reference of the logical state -------------------------------------------------


def logical_shards(tree):
  """A tree of ``[n, s_l]`` chunks -> numpy leaves of the parameters' shapes (padding dropped)."""
  cut = lambda x, p: np.asarray(x).reshape(-1)[: p.size].reshape(p.shape)
  return jax.tree.map(cut, tree, PARAMS)


def logical_flat(flat, n):
  """A flat ``[n*S]`` buffer (row i = chunk i of every leaf in order) -> tree of the params."""
  sizes = [p.size for p in jax.tree.leaves(PARAMS)]
  chunks = [-(-size // n) for size in sizes]
  rows = np.asarray(flat).reshape(n, sum(chunks))
  offsets = np.cumsum([0, *chunks])
  leaves = [
    rows[:, o : o + c].reshape(-1)[: p.size].reshape(p.shape)
    for o, c, p in zip(offsets, chunks, jax.tree.leaves(PARAMS), strict=False)
  ]
  return jax.tree.unflatten(jax.tree.structure(PARAMS), leaves)


def leaves(*trees):
  """The leaves of trees of one structure, side by side."""
  return zip(*map(jax.tree.leaves, trees), strict=True)


def bits(x):
  return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def padding(tree):
  """Every padded element of a tree of ``[n, s_l]`` chunks, concatenated."""
  return np.concatenate([np.asarray(x).reshape(-1)[p.size :] for x, p in leaves(tree, PARAMS)])


def logical(name, state):
  """Everything in ``state`` that must survive a reshard, as device-count-free numpy."""
  n = jax.tree.leaves(state.params)[0].shape[0]
  opt = state.opt_state.inner_state if name == "acco" else state.opt_state
  adam = opt[1][0]
  out = {
    "w": logical_flat(state.w, n),
    "params": logical_shards(state.params),
    "mu": logical_shards(adam.mu),
    "nu": logical_shards(adam.nu),
    "count": np.asarray(adam.count),
    "stage": np.asarray(state.stage),
    "pad": [padding(state.params), padding(adam.mu), padding(adam.nu)],
  }
  if name == "acco":
    out.update(committed=logical_shards(state.opt_state.committed))
    out.update(acco_stage=np.asarray(state.opt_state.stage))
  if state.buf is not None:
    out["buf_sum"] = logical_flat(np.asarray(state.buf, np.float64).sum(0), n)
    out["count_sum"] = int(np.asarray(state.buf_count).sum())
  return out


def assert_same_state(got, want):
  """Bitwise equal, except the gradient buffers' sums (float summation order)."""
  assert got.keys() == want.keys()
  for key in got:
    if key == "pad":
      assert all(not np.any(p) for p in got[key]), "padding of the new layout is not zero"
      continue
    tol = {"rtol": 1e-6, "atol": 1e-6} if key == "buf_sum" else None
    for g, w in leaves(got[key], want[key]):
      if tol:
        np.testing.assert_allclose(g, w, **tol, err_msg=key)
      else:  # bit patterns, so -0.0 and NaN payloads count
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=key)


# -- tests ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained():
  """Per method: the 8-device state after 3 stages (ACCO: mid-round, buffer with uneven counts)."""
  out = {}
  for name in ("acco", "zero1", "ddp"):
    train = build(name, N)
    state = train.init(PARAMS, first_microbatch())
    counts = [K, 1, K, K, 1, 1, K, K]  # devices contribute different numbers of microbatches
    for i, batch in enumerate(make_batches(3)):
      state, _ = train.step(state, batch, counts if i == 2 else None)
    out[name] = state
  assert int(out["acco"].stage) % 2 == 1  # the next ACCO stage commits the buffered gradients
  return out


@pytest.mark.parametrize("name", ["acco", "zero1", pytest.param("ddp", marks=pytest.mark.slow)])
def test_restore_on_4_then_2_then_8_devices_is_exact(tmp_path, trained, name):
  state = trained[name]
  reference = logical(name, state)
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state, extra={"stage": 3})
    for step, n in enumerate((4, 2, 8, 3), start=2):  # 3: nothing needs to divide
      train = build(name, n)
      target = train.abstract_state(PARAMS)
      restored, extra = ckpt.restore(None, target, reshard=train.reshard)
      assert extra == {"stage": 3}
      assert_same_state(logical(name, restored), reference)
      assert jax.tree.map(lambda x: x.sharding, restored) == jax.tree.map(
        lambda x: x.sharding, target
      )
      ckpt.save(step, restored, extra=extra)  # the next hop starts from this device count


def test_buffer_rows_merge_when_shrinking_and_move_when_growing(trained):
  saved = jax.tree.map(np.asarray, trained["acco"])
  four = build("acco", 4).reshard(saved)
  np.testing.assert_array_equal(four.buf_count, saved.buf_count.reshape(4, 2).sum(1))
  for j in range(4):
    pair = logical_flat(saved.buf[2 * j], N), logical_flat(saved.buf[2 * j + 1], N)
    for got, a, b in leaves(logical_flat(four.buf[j], 4), *pair):
      np.testing.assert_array_equal(got, a + b)  # float32: one addition, no rounding choice
  grown = build("acco", 8).reshard(four)  # each row of 4 moves to row 2j of 8, bit for bit
  np.testing.assert_array_equal(grown.buf_count[::2], four.buf_count)
  assert not grown.buf_count[1::2].any() and not grown.buf[1::2].any()
  for j in range(4):
    for got, want in leaves(logical_flat(grown.buf[2 * j], N), logical_flat(four.buf[j], 4)):
      np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("name,counts", [("acco", (8, 4, 2)), ("zero1", (8, 4))])
def test_training_continues_on_fewer_devices_along_the_same_trajectory(
  tmp_path, trained, name, counts
):
  batches = make_batches(2, seed=5)  # ACCO: a commit, then an estimate
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, trained[name], extra={})
    ends = {}
    for n in counts:
      train = build(name, n)
      state, _ = ckpt.restore(None, train.abstract_state(PARAMS), reshard=train.reshard)
      for batch in batches:  # the same 48 rows per stage: k = 2, 4, 8 microbatches per device
        state, metrics = train.step(state, batch)
        assert np.isfinite(float(metrics["loss"])) and float(metrics["microbatches"]) == 16
      ends[n] = (train.params(state), train.compute_params(state))
  for n in counts[1:]:
    for a, b in leaves(ends[n], ends[8]):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_another_model_is_a_clear_error(tmp_path, trained):
  wider = jax.tree.map(lambda x: x, PARAMS)
  wider["hidden"] = {"kernel": jnp.ones((5, 9)), "bias": jnp.zeros(9)}
  wider["out"]["kernel"] = jnp.ones((9, 3))
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, trained["acco"], extra={})
    for n in (8, 4):
      train = build("acco", n, wider)
      with pytest.raises(ValueError, match="another model or optimizer") as info:
        ckpt.restore(None, train.abstract_state(wider), reshard=train.reshard)
      assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)
    train = build("acco", 4)  # without reshard=, another device count stays a mismatch
    with pytest.raises(ValueError, match="written for a different state"):
      ckpt.restore(None, train.abstract_state(PARAMS))
    train = build("zero1", 4)  # another method: other leaves, no reshard attempted
    with pytest.raises(ValueError, match="written for a different state"):
      ckpt.restore(None, train.abstract_state(PARAMS), reshard=train.reshard)


def test_host_fingerprint_matches_the_device_one():
  r = np.random.default_rng(0)
  arrays = [
    r.normal(size=(3, 1000)).astype(np.float32),
    r.normal(size=(77,)).astype(jnp.bfloat16),
    r.integers(-5, 5, size=(9, 2)).astype(np.int32),
    r.integers(0, 255, size=(13,)).astype(np.uint8),
    r.normal(size=(4,)) > 0,
  ]
  device = fingerprint.fingerprints([jnp.asarray(a) for a in arrays])
  assert [fingerprint.hash_host(a) for a in arrays] == device


def test_data_position_carries_over_by_rows():
  tokens = np.arange(4 * 200, dtype=np.int32)  # 200 rows of seq_len + 1 = 4 tokens
  make = lambda g: data.batches(tokens, seq_len=3, global_batch_rows=g, seed=3)
  it = make(8)
  for _ in range(3):
    next(it)  # 24 rows consumed
  saved = it.get_state()
  for g, first in ((4, 24), (12, 24), (16, 32), (7, 28)):  # 16, 7: skip to the next boundary
    new = make(g)
    new.set_state(data.data_state(saved, g))
    reference = make(1)  # one row per batch: the row sequence itself
    reference.set_state({**reference.get_state(), "step": first})
    expected = np.concatenate([next(reference)["inputs"] for _ in range(g)])
    np.testing.assert_array_equal(next(new)["inputs"], expected)


@pytest.mark.slow  # two trainer runs: ~40 s of compilation on 2 cores
def test_trainer_resumes_on_another_device_count(tmp_path, capsys):
  from acco_jax.run import trainer
  from configs import gpt2_acco

  config = gpt2_acco.get_config("tiny")
  config.data.cache_dir = str(pathlib.Path(__file__).parent / ".." / ".pytest_cache" / "acco_data")
  config.ckpt.async_save = False
  config.train.num_updates, config.train.eval_every, config.train.sample_tokens = 3, 0, 0
  config.model.D, config.model.N, config.model.H = 16, 1, 1  # compile time dominates
  config.data.seq_len, config.train.eval_batches = 8, 1
  first = trainer.train_and_evaluate(config, str(tmp_path), max_stages=2)
  assert first["stopped"] == 2
  config.mesh.num_devices = 4
  capsys.readouterr()
  done = trainer.train_and_evaluate(config, str(tmp_path))
  out = capsys.readouterr().out
  assert "resharded the checkpoint of stage 2 from 8 to 4 devices" in out, out
  assert done["stages"] == 6 and math.isfinite(done["eval_loss"])
