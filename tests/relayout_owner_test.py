"""ckpt.init_from of an owner-layout state (issue 47, part 4): Muon's state, kept per owned matrix,
mapped back to the model's structure (acco_jax.dp.relayout_owner) and cut again for other owners.

Against the plain layout: ZeRO-1 with the owner layout and DDP with whole leaves run the same
optimizer on the same batches, so the owner run's exported state (θ, Muon's momentum, SGD's trace
and the counts in the model's structure) must be the DDP run's own state, to float32 tolerances (another
program; see owner_step_test for the noise). A momentum given to another matrix, or transposed,
is off by its whole size. Carrying back into ACCO's owner layout on another device count moves bits
only: exported again, it is bit for bit what went in.
"""

import jax
import numpy as np
import pytest

import acco_jax
from acco_jax.ckpt import portable
from acco_jax.dp import relayout_owner
from tests.methods_test import B, K, N, first_microbatch, make_batches
from tests.owner_step_test import loss_with_stack, params_with_stack

RTOL = 1e-3  # of each leaf's largest value (owner_step_test: Muon's noise is 5e-5 of itself)


def muon():
  """Muon on the matrices (the stacked leaf: 11 matrices of 4 x 6), SGD with momentum on the
  vectors: no Adam-type step, whose normalisation would turn a last-bit difference between the two
  layouts' gradient sums into a learning-rate-sized step on another CPU."""
  import optax

  stacked = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  dims = lambda p: jax.tree.map(  # noqa: E731
    lambda x: stacked if x.ndim == 3 else optax.contrib.MuonDimensionNumbers(), p
  )
  labels = lambda p: jax.tree.map(lambda x: "muon" if x.ndim >= 2 else "sgd", p)  # noqa: E731
  return optax.partition(
    {
      "muon": optax.contrib.muon(3e-2, weight_decay=0.01, muon_weight_dimension_numbers=dims),
      "sgd": optax.sgd(1e-2, momentum=0.9),
    },
    labels,
  )


def _run(tx, params, n, stages):
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
  step = acco_jax.make_train_step(loss_with_stack, tx, mesh, num_microbatches=K, params=params)
  state = step.init(params, jax.tree.map(lambda x: x[: n * B], first_microbatch()))
  for batch in make_batches(stages)[:stages]:
    state, _ = step.step(state, batch)
  return step, state


def _close(got, want, what):
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for (path, x), y in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
  ):
    x, y = np.asarray(x), np.asarray(y)
    where = f"{what}{jax.tree_util.keystr(path)}"
    assert x.shape == y.shape and x.dtype == y.dtype, where
    if not np.issubdtype(x.dtype, np.floating) or not np.any(y):
      np.testing.assert_array_equal(x, y, err_msg=where)
      continue
    scale = float(np.max(np.abs(y)))
    np.testing.assert_allclose(x, y, rtol=0, atol=RTOL * scale, err_msg=where)


@pytest.fixture(scope="module")
def runs():
  params = params_with_stack()
  owner, s_owner = _run(acco_jax.zero1(muon(), layout="owner"), params, N, 3)
  plain, s_plain = _run(acco_jax.ddp(muon()), params, N, 3)
  return params, owner, portable.to_host(s_owner), plain, portable.to_host(s_plain)


def test_owner_state_is_the_plain_layouts_in_the_models_structure(runs):
  params, owner, s_owner, plain, s_plain = runs
  assert owner.owner and not plain.owner
  exported = owner.export_state(s_owner)
  assert exported.updates == 3 and exported.source == "zero1"
  _close(exported.params, plain.export_state(s_plain).params, "params")
  # the moved momentum and moments: the DDP run's own optimizer state, leaf by leaf
  _close(exported.opt, s_plain.opt_state, "opt")
  momentum = [x for x in jax.tree.leaves(exported.opt) if np.shape(x) == (11, 4, 6)]
  assert momentum and np.any(momentum[0]), "Muon's momentum of the stacked matrices moved"


def test_owner_state_moves_to_other_owners_bit_for_bit(runs):
  params, owner, s_owner, _, _ = runs
  exported = owner.export_state(s_owner)
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  acco = acco_jax.make_train_step(
    loss_with_stack,
    acco_jax.acco(muon(), layout="owner"),
    mesh,
    num_microbatches=K,
    params=params,
  )
  mb = jax.tree.map(lambda x: x[: 4 * B], first_microbatch())
  state = portable.to_host(acco.import_state(exported, 2 * exported.updates, mb))
  assert acco.owner and int(np.ravel(state.opt_state.stage)[0]) == 6
  again = acco.export_state(state)
  for what in ("params", "opt"):
    got, want = getattr(again, what), getattr(exported, what)
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def test_a_state_of_another_optimizer_is_refused(runs):
  import optax

  _, owner, s_owner, _, _ = runs
  layout = owner.layout
  like = layout.treedef.unflatten(
    [jax.ShapeDtypeStruct(s, d) for s, d in zip(layout.shapes, layout.dtypes, strict=True)]
  )
  with pytest.raises(ValueError, match="another inner optimizer|not this inner optimizer"):
    relayout_owner.to_model(
      s_owner.opt_state, layout, owner.tx.inner, optax.sgd(0.1, momentum=0.9), like
    )


def test_a_checkpoint_of_another_count_is_read_and_exported(runs, tmp_path):
  """What ckpt.init_from does with an owner-layout checkpoint of 8 devices from a run on 4: the
  target's paths are other slots, so ``restore_host`` reads the saved structure that
  ``saved_like`` gives, and the export is the 8-device step's, bit for bit."""
  from acco_jax.ckpt.checkpoint import Checkpointer

  params, owner, s_owner, _, _ = runs
  with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
    ckpt.save(3, jax.tree.map(jax.numpy.asarray, s_owner), extra={"stage": 3})
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  four = acco_jax.make_train_step(
    loss_with_stack,
    acco_jax.zero1(muon(), layout="owner"),
    mesh,
    num_microbatches=K,
    params=params,
  )
  with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
    host, extra = ckpt.restore_host(None, lambda e: four.abstract_state(params), four.saved_like)
  assert extra == {"stage": 3} and jax.tree.leaves(host.params)[0].shape[0] == N
  got, want = four.export_state(host), owner.export_state(s_owner)
  for what in ("params", "opt"):
    for x, y in zip(
      jax.tree.leaves(getattr(got, what)), jax.tree.leaves(getattr(want, what)), strict=True
    ):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)
  # without saved_like the 4-device target's paths are refused as another state
  with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt, pytest.raises(ValueError):
    ckpt.restore_host(None, lambda e: four.abstract_state(params))
