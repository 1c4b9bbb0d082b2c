"""Per-leaf optimizers under zero1 and acco with the owner layout, against single-device references.

Muon orthogonalises each weight matrix's momentum, Adafactor factors each matrix's second moment:
neither is elementwise, so the elementwise ZeRO-1 layout refuses them; with ``layout='owner'`` each
matrix is whole on one device and the result must be plain optax's on the mean gradient.

Every comparison is of *updates*, ``θ − θ_0``, at a tolerance relative to the reference's update
(``tests.methods_test.assert_updates_close``), over the first steps only: the library and the
references sum the gradients in other orders (XLA's choice, per CPU), an optimizer that normalises
its update (Muon's Newton-Schulz, Adafactor's and Adam's ``g / sqrt(v)``) carries that noise into
every later step, and, being homogeneous of degree 0 in the gradient, tests its scale not at all.
Measured here with an extra absolute noise of ``1e-6 max|g|`` on every gradient (more than twice
what reordering a float32 sum of n terms changes, about ``√n · 6e-8`` of their size: ``4e-7`` for the
48 rows of a batch here), over the first 4 steps (zero1) or stages (ACCO): Muon's update moves by
at most ``5e-5`` of itself, Adafactor's ``4e-5``, SGD with momentum's ``7e-6``; the library is
within ``4e-6`` of the references, here and with XLA generating SSE4.2 code at optimisation level 3
(.ci/run). So ``UPDATE_RTOL = 1e-3`` keeps a margin of 20 over that noise, while an optimizer given
chunks (rows of a matrix, another owner's slot) or an ACCO stage that drops a term moves the update
by several percent of itself. The ACCO algebra (which gradients are summed over how many
microbatches, which optimizer state a commit starts from) is checked with SGD with momentum,
linear in the gradient: a sum in place of the mean leaves the zero1 Muon and Adafactor updates
unchanged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acco_jax
from tests.methods_test import (
  FULL,
  UNEQUAL,
  K,
  N,
  as_f32,
  assert_updates_close,
  first_microbatch,
  init_params,
  loss_fn,
  make_batches,
  ref_acco,
  ref_sync,
  run_library,
)

UPDATE_RTOL = 1e-3  # of the reference's update, per leaf (module docstring)


def sgd_momentum():
  """A linear optimizer (with state) for the layout's arithmetic: scale errors stay visible."""
  return optax.sgd(0.1, momentum=0.9)


def params_with_stack():
  """The methods_test model plus a leaf stacking 11 matrices (8 devices: 3 empty slots)."""
  p = init_params()
  p["stack"] = np.random.default_rng(3).normal(size=(11, 4, 6)) * 0.3
  return as_f32(p)


def muon():
  # the stacked leaf is 11 matrices of 4 x 6 (batch axis 0), the 2-D kernels one matrix each
  dims = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  return optax.contrib.muon(
    3e-2,
    adam_learning_rate=1e-2,
    weight_decay=0.01,
    muon_weight_dimension_numbers=lambda p: jax.tree.map(
      lambda x: (
        dims if x.ndim == 3 else optax.contrib.MuonDimensionNumbers() if x.ndim == 2 else None
      ),
      p,
    ),
  )


def adafactor():
  return optax.adafactor(1e-2, min_dim_size_to_factor=3)


def loss_with_stack(p, mb):
  if "stack" not in p:
    return loss_fn(p, mb)
  # one term per matrix of the stack (so that SGD moves each well above its float32 rounding)
  per_matrix = jnp.mean(jnp.tanh(mb["x"][:, :4] @ p["stack"]) ** 2, axis=(1, 2))
  return loss_fn(p, mb) + jnp.sum(per_matrix)


@pytest.fixture(autouse=True)
def _stacked_loss(monkeypatch):
  import tests.methods_test as mt

  monkeypatch.setattr(mt, "loss_fn", loss_with_stack)
  monkeypatch.setattr(mt, "grad", jax.jit(jax.grad(loss_with_stack)))


def run_stages(tx, params, batches, counts):
  """The library's ``(params, compute params)`` after each stage."""
  mesh = jax.make_mesh((N,), ("data",))
  train = acco_jax.make_train_step(loss_with_stack, tx, mesh, num_microbatches=K, params=params)
  state, out = train.init(params, first_microbatch()), []
  for batch in batches:
    state, _ = train.step(state, batch, counts)
    out.append((train.params(state), train.compute_params(state)))
  return state, out


# Adafactor factors a 3-D leaf over its two largest axes (the stack among them): per leaf, not per
# matrix, so its case has no stacked leaf
@pytest.mark.parametrize(
  "inner,params",
  [
    (muon, params_with_stack),
    pytest.param(adafactor, lambda: as_f32(init_params()), marks=pytest.mark.slow),
  ],
  ids=["muon", "adafactor"],
)  # (the slow variants run in .ci/run's slow step: the README command's time is bounded)
def test_zero1_owner_equals_plain_optax_on_the_mean_gradient(inner, params):
  """Two steps: the second adds the first's momentum (Muon's Nesterov trace, the vectors' Adam
  moments; Adafactor's factored second moment) and Muon's weight decay moves both."""
  params, batches = params(), make_batches(2)
  tx = acco_jax.zero1(inner(), comm_dtype=jnp.float32, layout="owner")
  train, state = run_library(tx, params, batches, [FULL] * 2)
  ref = ref_sync(inner(), params, batches, [FULL] * 2)
  assert_updates_close(train.params(state), ref, params, UPDATE_RTOL)
  # the state is sharded: each owned matrix's momentum lives on one device
  assert all(x.sharding.spec[0] == "data" for x in jax.tree.leaves(state.params))


@pytest.mark.parametrize(
  "inner,params",
  [
    (muon, params_with_stack),
    pytest.param(adafactor, lambda: as_f32(init_params()), marks=pytest.mark.slow),
  ],
  ids=["muon", "adafactor"],
)
def test_ddp_gives_a_non_elementwise_optimizer_the_whole_parameters(inner, params):
  """Not the owner layout: DDP's optimizer sees the tree of original shapes, not [N, s_l] chunks
  (on chunks Muon's update is another matrix altogether, far outside the tolerance)."""
  params, batches = params(), make_batches(2)
  train, state = run_library(
    acco_jax.ddp(inner(), comm_dtype=jnp.float32), params, batches, [FULL] * 2
  )
  ref = ref_sync(inner(), params, batches, [FULL] * 2)
  assert_updates_close(train.params(state), ref, params, UPDATE_RTOL)
  assert jax.tree.structure(state.params) == jax.tree.structure(params)


@pytest.mark.parametrize(
  "inner,counts",
  [
    (sgd_momentum, FULL),
    pytest.param(sgd_momentum, UNEQUAL, marks=pytest.mark.slow),
    pytest.param(muon, FULL, marks=pytest.mark.slow),
  ],
  ids=["sgdm-equal", "sgdm-unequal", "muon-equal"],
)
def test_acco_owner_matches_reference(inner, counts):
  """Four stages: estimate, commit, estimate, commit. After the third, θ is the first commit (the
  first microbatch's gradients and stage 0's, over both counts, from the initial optimizer state:
  the estimate's is discarded) and the compute weights are the second estimate (stage 1's gradients
  only, taken at the first estimate, from the committed momentum); after the fourth, θ is the
  second commit (stages 1 and 2 from the first commit's state)."""
  params, stages = params_with_stack(), 4
  batches = make_batches(stages)
  tx = acco_jax.acco(inner(), comm_dtype=jnp.float32, layout="owner")
  _, got = run_stages(tx, params, batches, counts)
  for t in (3, 4):
    theta, w, _ = ref_acco(inner(), params, first_microbatch(), batches[:t], [counts] * t)
    assert_updates_close(got[t - 1][0], theta, params, UPDATE_RTOL)
    assert_updates_close(got[t - 1][1], w, params, UPDATE_RTOL)


def clipped_muon(clip=0.05):
  return optax.chain(optax.clip_by_global_norm(clip), muon())


@pytest.mark.parametrize(
  "name,inner,params,stages",
  [
    ("acco", clipped_muon, params_with_stack, 4),
    pytest.param("zero1", clipped_muon, params_with_stack, 2, marks=pytest.mark.slow),
    pytest.param("zero1", adafactor, lambda: as_f32(init_params()), 2, marks=pytest.mark.slow),
  ],
  ids=["acco-clipped-muon", "zero1-clipped-muon", "zero1-adafactor"],
)
def test_public_api_defaults_take_the_owner_layout(name, inner, params, stages):
  """``acco_jax.acco`` / ``zero1`` with their defaults (``layout='auto'``) on an optimizer that
  needs whole matrices: the owner layout is chosen, an ``optax.clip_by_global_norm`` first in the
  chain clips by the norm of the whole mean gradient (it acts at every update here; a per-owner
  clip moves the update by far more than the tolerance), and the result is plain optax's."""
  params, batches = params(), make_batches(stages)
  tx = getattr(acco_jax, name)(inner(), comm_dtype=jnp.float32)
  mesh = jax.make_mesh((N,), ("data",))
  train = acco_jax.make_train_step(loss_with_stack, tx, mesh, num_microbatches=K, params=params)
  assert train.owner and train.plan.layout == "owner"
  state, norms = train.init(params, first_microbatch()), []
  for batch in batches:
    state, m = train.step(state, batch)
    norms.append(float(m["grad_norm"]))
  if inner is clipped_muon:
    assert min(norms) > 2 * 0.05
  if name == "acco":
    ref, _, _ = ref_acco(inner(), params, first_microbatch(), batches, [FULL] * stages)
  else:
    ref = ref_sync(inner(), params, batches, [FULL] * stages)
  assert_updates_close(train.params(state), ref, params, UPDATE_RTOL)


def test_owner_layout_refusals():
  params, mesh = params_with_stack(), jax.make_mesh((N,), ("data",))
  with pytest.raises(ValueError, match="does not take quantize='int8'"):
    acco_jax.zero1(muon(), layout="owner", quantize="int8")
  with pytest.raises(ValueError, match="layout='rows' is unknown"):
    acco_jax.acco(muon(), layout="rows")
  # a global-norm clip after another transform reads every leaf where the step cannot apply it
  late_clip = optax.chain(optax.scale(2.0), optax.clip_by_global_norm(0.1), muon())
  with pytest.raises(ValueError, match="its update of one leaf reads others") as info:
    acco_jax.make_train_step(
      loss_with_stack,
      acco_jax.acco(late_clip, layout="owner"),
      mesh,
      num_microbatches=1,
      params=params,
    )
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["acco", pytest.param("zero1", marks=pytest.mark.slow)])
@pytest.mark.parametrize("inner", [muon, sgd_momentum], ids=["muon", "sgdm"])
def test_owner_step_moves_one_row_each_way_and_overlaps_like_elementwise(name, inner):
  """The compiled stage has the elementwise layout's two collectives, of the owners' rows; the
  vmapped optimizer adds none (each device updates its own slots) and ACCO still overlaps."""
  from acco_jax.analysis import dataflow, hlo
  from tests.step_test import stage_program

  params, mesh = params_with_stack(), jax.make_mesh((N,), ("data",))
  tx = acco_jax.get_method(name, inner(), comm_dtype=jnp.float32, layout="owner")
  train = acco_jax.make_train_step(loss_with_stack, tx, mesh, num_microbatches=2, params=params)
  state = train.init(params, first_microbatch())
  fn, args = stage_program(train, state)
  report = dataflow.dataflow_report(jax.make_jaxpr(fn)(*args), psum_limit=16)
  assert report.collectives_in_loop == () and report.large_psums == ()
  if inner is not muon:  # the analysis counts Newton-Schulz's loops as microbatch loops
    assert report.loops == (2 if train.plan.delayed else 1)
    assert report.overlappable == train.plan.delayed
  found = hlo.hlo_collectives(fn.lower(*args).compile().as_text())
  row_bytes = train.layout.padded_size * 4
  big = sorted((c.kind, c.bytes) for c in found if c.bytes >= 256)
  assert big == [("all-gather", row_bytes), ("reduce-scatter", row_bytes)], found
  sharded = [x for x in jax.tree.leaves((state.params, state.opt_state)) if x.ndim >= 2]
  assert all(x.sharding.spec[0] == "data" for x in sharded)


# -- the config's Muon + AdamW (acco_jax.optim) with a global-norm clip -------------------------


def muon_leaves(params):
  """Muon on the 2-D kernels and the stacked matrices, AdamW on the biases and the scale."""
  return jax.tree.map(lambda x: np.ndim(x) >= 2, params)


def muon_adamw_clipped(muon_mask, decay_mask, clip):
  from acco_jax import optim

  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20, 1e-3)
  inner = optim.muon_adamw(
    schedule, lambda t: 3 * schedule(t), muon_mask, weight_decay=0.1, decay_mask=decay_mask
  )
  return optax.chain(clip, inner)


@pytest.mark.parametrize("name", ["acco", pytest.param("zero1", marks=pytest.mark.slow)])
def test_owner_clip_by_global_norm_is_global_across_owners(name):
  """chain(clip_by_global_norm, muon + adamw) with the owner layout (Muon's matrices owned, the
  rest elementwise) equals plain optax's on one device: the clip reads the norm of the whole mean
  gradient, not of one device's items."""
  from acco_jax import optim
  from acco_jax.dp.owner import OwnerLayout

  params, stages, clip = params_with_stack(), 4, 0.05
  batches, owned = make_batches(stages), muon_leaves(params)
  decay = jax.tree.map(lambda x: np.ndim(x) >= 2, params)
  decay["out"]["kernel"] = False  # a mask that differs from Muon's labels
  view = OwnerLayout(params, N, owned).view
  inner = muon_adamw_clipped(view(owned), view(decay), optim.clip_by_global_norm(clip))
  mesh = jax.make_mesh((N,), ("data",))
  tx = acco_jax.get_method(name, inner, comm_dtype=jnp.float32, layout="owner")
  train = acco_jax.make_train_step(
    loss_with_stack, tx, mesh, num_microbatches=2, params=params, owned=owned
  )
  state = train.init(params, first_microbatch())
  norms = []
  for batch in batches:
    state, m = train.step(state, batch)
    norms.append(float(m["grad_norm"]))
  assert min(norms) > 2 * clip  # the clip acts at every update
  ref_inner = lambda: muon_adamw_clipped(owned, decay, optax.clip_by_global_norm(clip))
  if name == "acco":
    theta, _, _ = ref_acco(ref_inner(), params, first_microbatch(), batches, [FULL] * stages)
  else:
    theta = ref_sync(ref_inner(), params, batches, [FULL] * stages)
  # tolerance relative to each leaf's update (Newton-Schulz amplifies float noise)
  assert_updates_close(train.params(state), theta, params, 1e-3)
  assert train.layout.elem and train.layout.groups  # both parts are exercised


# -- elastic restore: owners reassigned --------------------------------------------------------------


def owner_step(name, n, params):
  """``name`` with the config's Muon + AdamW (global clip) on ``n`` devices, one global batch."""
  from acco_jax import optim
  from acco_jax.dp.owner import OwnerLayout

  owned, decay = muon_leaves(params), jax.tree.map(lambda x: np.ndim(x) >= 2, params)
  view = OwnerLayout(params, n, owned).view
  inner = muon_adamw_clipped(view(owned), view(decay), optim.clip_by_global_norm(1.0))
  tx = acco_jax.get_method(name, inner, comm_dtype=jnp.float32, layout="owner")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
  train = acco_jax.make_train_step(
    loss_with_stack, tx, mesh, num_microbatches=N * K // n, params=params, owned=owned
  )
  train.source_tx = lambda m: owner_step(name, m, params).tx  # its masks are in m's view
  return train


@pytest.mark.slow  # ~40 s: owners reassigned for 4 devices (the elementwise case: elastic_test)
def test_owner_state_moves_to_another_device_count(tmp_path):
  """ACCO + Muon saved mid-round on 8 devices restores on 4 (owners reassigned, other slot counts):
  θ and the compute weights bit for bit, the 8 -> 4 -> 8 round trip gives back every leaf of the
  state bit for bit (the gradient rows: their sum), and the next stage on 4 devices (the commit:
  one optimizer update from the moved state, so no several Adam-type steps compared) follows the
  8-device run (Muon's momentum, Adam's moments and the buffered gradients carried)."""
  from acco_jax.ckpt.checkpoint import Checkpointer

  params, batches = params_with_stack(), make_batches(4)
  train8 = owner_step("acco", 8, params)
  state = train8.init(params, first_microbatch())
  for batch in batches[:3]:
    state, _ = train8.step(state, batch)
  train4 = owner_step("acco", 4, params)
  assert train4.layout.slots != train8.layout.slots  # other slots, other owners
  bits = lambda t: [np.asarray(x).tobytes() for x in jax.tree.leaves(t)]
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state, extra={})
    restore = lambda t: ckpt.restore(
      None, t.abstract_state(params), reshard=t.reshard, saved_like=t.saved_like
    )[0]
    moved = restore(train4)
    ckpt.save(2, moved, extra={})
    back = restore(train8)
  assert bits(train4.params(moved)) == bits(train8.params(state))
  assert bits(train4.compute_params(moved)) == bits(train8.compute_params(state))
  assert bits(back._replace(buf=None, buf_count=None)) == bits(
    state._replace(buf=None, buf_count=None)
  )
  np.testing.assert_allclose(np.sum(back.buf, 0), np.sum(state.buf, 0), rtol=1e-6, atol=1e-7)
  assert int(np.sum(back.buf_count)) == int(np.sum(state.buf_count))
  for batch in batches[3:]:
    state, _ = train8.step(state, batch)
    moved, _ = train4.step(moved, batch)
  assert_updates_close(train4.params(moved), train8.params(state), params, UPDATE_RTOL)
