"""Muon in the pipeline (issue 47, part 4): each block's matrices packed apart, owned whole by the
lanes of their stage (acco_jax.pipeline.packing's ``matrices``), and Muon run on stacks of them.

The reference is plain optax on the model's whole tree (the "plain layout"): Muon on the blocks'
matrices, SGD with momentum on everything else, after a global-norm clip, with the single-device
model's mean gradient; the pipeline is another program, so float32 tolerances, not bits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from acco_jax import errors, model, optim
from acco_jax.pipeline import packing, ticks
from acco_jax.pipeline import programs as pipe
from acco_jax.pipeline import step as pipe_train
from acco_jax.run import build
from configs import gpt2_pipeline
from tests.pipeline_data_test import CFG, LANES, B, M, S, _batches, _close, _mean_grad
from tests.train_test import tiny

COUNTS = (1, 3)  # K = 3 slots, K' = 4 over 2 lanes: stage 0 has 3 empty slots, stage 1 one
CLIP, MUON_LR, SGD_LR = 1.0, 2e-2, 5e-2


def _labelled(muon_mask, dims=None):
  """Clip, then Muon where ``muon_mask`` and SGD with momentum elsewhere."""
  labels = jax.tree.map(lambda m: "muon" if m else "sgd", muon_mask)
  inner = optax.partition(
    {
      "muon": optax.contrib.muon(MUON_LR, weight_decay=0.01, muon_weight_dimension_numbers=dims),
      "sgd": optax.sgd(SGD_LR, momentum=0.9),
    },
    labels,
  )
  return optax.chain(optax.clip_by_global_norm(CLIP), inner)


def _matrices(params):
  return model.muon_mask(params)["blocks"]["0"]


def _step(params, data_method):
  mesh = pipe.make_mesh(S, LANES, jax.devices()[: S * LANES])
  sched = ticks.build([(1,)] * M, S, "gpipe")
  pk = pipe.packing_for(params, S, COUNTS, LANES, _matrices(params))
  dims = lambda tree: jax.tree.map(lambda _: optim.MUON_DIMS, tree)
  tx = packing.on_view(_labelled(pk.view_mask(model.muon_mask(params)), dims), pk)
  return pipe_train.PipelineStep(
    CFG, tx, mesh, sched, params, None, COUNTS, data_method, jnp.float32, _matrices(params)
  )


@pytest.fixture(scope="module")
def params():
  return jax.tree.map(np.asarray, model.init_params(CFG, 0))


def test_matrices_are_packed_whole_in_slots_the_lanes_divide(params):
  pk = pipe.packing_for(params, S, COUNTS, LANES, _matrices(params))
  assert pk.matrix_slots == 4 and set(pk.sizes) == {"matrices", "decay", "nodecay"}
  packed = pk.pack(params)
  back = pk.unpack(packed)  # moves bits, as the two-buffer packing
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(a, b)
  view = pk.view(packed)
  # stage 1's third block (model block 3) is slot 2 of stage 1; the empty slots are zeros
  kernel = view["matrices"]["mlp_fc"]["kernel"]
  assert kernel.shape == (S, 4, CFG.D, 4 * CFG.D)
  np.testing.assert_array_equal(kernel[1, 2], params["blocks"]["3"]["mlp_fc"]["kernel"])
  assert not np.any(kernel[0, 1:]) and not np.any(kernel[1, 3])
  # each lane's half of the buffer is whole slots: 2 of the 4, every matrix of a slot in it
  half = packed["matrices"].shape[1] // LANES
  assert half % (packed["matrices"].shape[1] // 4) == 0
  for a, b in zip(
    jax.tree.leaves(pk.unview(view)), jax.tree.leaves(packed), strict=True
  ):  # the view moves bits both ways
    np.testing.assert_array_equal(a, b)
  # no matrix is left in the elementwise buffers
  mask = pk.view_mask(model.muon_mask(params))
  assert mask["decay"] is False and mask["nodecay"] is False
  assert all(jax.tree.leaves(mask["matrices"]))


def _reference(params, batches, data_method):
  """The plain layout: optax on the model's tree with the mean gradient (ACCO: the estimate at θ
  after a fill, then estimate-commit rounds)."""
  tx = _labelled(model.muon_mask(params))
  theta = jax.tree.map(jnp.asarray, params)
  state = tx.init(theta)
  order = np.arange(CFG.N, dtype=np.int32)
  grad = lambda w, b: jax.tree.map(jnp.float32, _mean_grad(w, b, M, LANES, order))
  apply = lambda w, g, s: (lambda u, s2: (optax.apply_updates(w, u), s2))(*tx.update(g, s, w))
  if data_method != "acco":
    for b in batches:
      theta, state = apply(theta, grad(theta, b), state)
    return theta
  # acco: flush 1 fills at θ0, then (estimate, commit) pairs (see pipeline_data_test)
  g_prev, w = grad(theta, batches[0]), theta
  for i in range(1, len(batches), 2):
    g_est = grad(w, batches[i])
    estimate, _ = apply(theta, g_prev, state)
    g_tilde = grad(estimate, batches[i + 1])
    theta, state = apply(theta, jax.tree.map(lambda a, b: (a + b) / 2, g_prev, g_est), state)
    g_prev, w = g_tilde, theta
  return theta


@pytest.mark.parametrize(
  "data_method,flushes",
  [pytest.param(d, n, marks=pytest.mark.slow) for d, n in (("ddp", 2), ("zero1", 3), ("acco", 5))],
)
def test_muon_over_a_stages_lanes_equals_the_plain_layout(params, data_method, flushes):
  batches = _batches(flushes, M * LANES * B, seed=3)
  train = _step(params, data_method)
  state = train.init(params)
  for b in batches:
    state, _ = train.step(state, b)
  # Muon's momentum is a stack of whole matrices, its slots split over the lanes (owners; ddp:
  # every lane holds every slot)
  inner = state.opt_state.inner_state if data_method == "acco" else state.opt_state
  stacks = [x for x in jax.tree.leaves(inner) if x.ndim == 4]
  owned = ("stage",) if data_method == "ddp" else ("stage", "data")
  assert stacks and all(tuple(x.sharding.spec) == owned for x in stacks)
  per_lane = stacks[0].sharding.shard_shape(stacks[0].shape)[1]
  assert per_lane == (4 if data_method == "ddp" else 2)
  ref = _reference(params, batches, data_method)
  _close(train.params(state), ref, params)


def test_muon_on_the_packed_buffers_is_plain_optax_on_the_tree(params):
  """The optimizer the pipeline runs (Muon on the view of the packed buffers) against plain optax
  on the model's tree, three steps of the same gradients, without the pipeline's program (the
  slow tests above run it); and the state it keeps, sharded as the lanes own it."""
  pk = pipe.packing_for(params, S, COUNTS, LANES, _matrices(params))
  dims = lambda tree: jax.tree.map(lambda _: optim.MUON_DIMS, tree)
  on_buffers = packing.on_view(_labelled(pk.view_mask(model.muon_mask(params)), dims), pk)
  on_tree = _labelled(model.muon_mask(params))
  rng = np.random.default_rng(4)
  grads = [
    jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32) * 0.1, params)
    for _ in range(3)
  ]

  def run(tx, start, to):
    step = jax.jit(
      lambda p, g, s: (lambda u, s2: (optax.apply_updates(p, u), s2))(*tx.update(g, s, p))
    )
    p, s = start, tx.init(start)
    for g in grads:
      p, s = step(p, to(g), s)
    return p

  got = pk.unpack(jax.device_get(run(on_buffers, pk.pack(params), pk.pack)))
  want = run(on_tree, jax.tree.map(jnp.asarray, params), lambda g: g)
  _close(got, want, params)
  # the lanes own whole matrices: Muon's momentum stacks split their slots over ``data``
  state = _step(params, "zero1").abstract_state(params)
  stacks = [x for x in jax.tree.leaves(state.opt_state) if x.ndim == 4]
  assert stacks and all(tuple(x.sharding.spec) == ("stage", "data") for x in stacks)
  assert stacks[0].sharding.shard_shape(stacks[0].shape)[1] == 2


def test_config_builds_muon_in_the_pipeline_and_keeps_the_refusals():
  config = tiny(gpt2_pipeline, **{"opt.name": "muon", "pipeline.data_method": "zero1"})
  run = build.build(config)
  assert run.step.packing.matrix_slots > 0 and "matrices" in run.step.packing.sizes
  config = tiny(gpt2_pipeline, **{"opt.name": "muon", "comm.quantize": "int8"})
  with pytest.raises(errors.UserValueError, match="comm.quantize is not supported"):
    build.build(config)
