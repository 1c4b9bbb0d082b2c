"""MuLoCo: DiLoCo's workers running Muon inside, with the owner layout of a ZeRO-1 inner step.

Each worker's ``D`` devices own its matrices whole (:class:`acco_jax.dp.owner.OwnerLayout`), so the
inner optimizer can orthogonalise them; the outer step and its all-reduce over ``replica`` see the
owner layout's shards instead of flat chunks. Compared with ``tests.loco_test.ref_loco``, each
worker on whole parameter trees with plain optax, as *updates* at a tolerance relative to the
reference's update (``tests.methods_test.assert_updates_close``; why updates and why 1e-3:
``tests/owner_step_test.py``'s docstring).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acco_jax
from acco_jax import loco, optim
from acco_jax.dp.owner import OwnerLayout
from acco_jax.loco import step as loco_step
from tests.loco_test import K, ref_loco, run, toy_batches, toy_loss, toy_params
from tests.methods_test import assert_updates_close

M, D, H, CLIP = 2, 4, 2, 0.3  # workers, devices per worker, inner steps per sync, clip norm


def muon(clip):
  """Muon on the matrices, SGD with momentum on the vectors (no Adam-type step: after several of
  those a near-zero gradient turns summation-order noise into a learning-rate-sized step), after a
  clip."""
  labels = lambda tree: jax.tree.map(lambda x: "muon" if x.ndim == 2 else "sgd", tree)
  inner = optax.partition(
    {"muon": optax.contrib.muon(2e-2, weight_decay=0.01), "sgd": optax.sgd(1e-2, momentum=0.9)},
    labels,
  )
  return optax.chain(clip, inner)


def owner_step(method, inner):
  params = toy_params()
  mesh = loco_step.worker_mesh(M, jax.devices()[: M * D])
  tx = acco_jax.zero1(inner, comm_dtype=jnp.float32, layout="owner")
  return loco_step.make_loco_step(
    toy_loss, tx, method, mesh, num_microbatches=K, params=params, elementwise=False
  )


@pytest.mark.slow  # ~29 s: the reference over 2 syncs (the layout: test_owner_layout_moves_what_the_elementwise_layout_moves)
def test_muloco_matches_reference():
  """Two syncs of H = 2: θ_g and every worker's θ_m equal the reference's, with the clip acting
  (a global norm per worker, not per owner) and the outer Nesterov step on the mean Δ."""
  params, batches = toy_params(), toy_batches(2 * H, M * D * K * 2)
  tx = acco_jax.zero1(muon(optim.clip_by_global_norm(CLIP)), comm_dtype=jnp.float32, layout="owner")
  train, state, logged = run(loco.diloco(sync_every=H), M, D, batches, inner_name=tx)
  assert isinstance(train.layout, OwnerLayout) and train.layout.groups
  assert min(float(np.min(r["grad_norm"])) for r in logged) > 2 * CLIP  # the clip always acts
  assert [int("outer_fragment" in r) for r in logged] == [0, 1, 0, 1]
  glob, theta, _ = ref_loco(params, batches, M, D, H, inner=muon(optax.clip_by_global_norm(CLIP)))
  assert_updates_close(train.params(state), glob, params, 1e-3)
  workers = train.worker_params(state)
  for m in range(M):
    assert_updates_close(jax.tree.map(lambda x, m=m: x[m], workers), theta[m], params, 1e-3)
  # each worker's owned matrices live on one of its devices: [M, D, a, b], sharded over both axes
  owned = state.inner.params["owned"]
  assert owned and all(x.sharding.spec[:2] == ("replica", "data") for x in owned)


@pytest.mark.parametrize("name", ["diloco", pytest.param("noloco", marks=pytest.mark.slow)])
def test_owner_layout_moves_what_the_elementwise_layout_moves(name):
  """An elementwise inner optimizer (SGD with momentum) gives the same run on both layouts: the
  sync's buffer (owned matrices raveled end to end, NoLoCo's [Δ | φ] pair exchange) carries each
  shard back to its place."""
  method = loco.diloco(sync_every=H) if name == "diloco" else loco.noloco(H, outer_lr=0.7)
  params, batches = toy_params(), toy_batches(2 * H, M * D * K * 2)
  sgdm = lambda: optax.sgd(0.1, momentum=0.9)
  out = {}
  for layout in ("owner", "elementwise"):
    tx = acco_jax.zero1(sgdm(), comm_dtype=jnp.float32, layout=layout)
    train, state, _ = run(method, M, D, batches, inner_name=tx)
    out[layout] = train.worker_params(state)
  assert_updates_close(
    out["owner"], out["elementwise"], jax.tree.map(lambda x: x[None], params), 1e-4
  )


@pytest.mark.parametrize(
  "method,fix",
  [
    (loco.streaming_diloco(4, 2), "loco.fragments=2"),
    (loco.streaming_diloco(4, 1, quantize="fp4"), "loco.quantize=fp4"),
    (loco.sparseloco(4, topk=4, chunk=8), "method=sparseloco's sparse payload"),
  ],
)
def test_owner_layout_refuses_what_it_cannot_carry(method, fix):
  with pytest.raises(ValueError, match=fix):
    owner_step(method, muon(optim.clip_by_global_norm(CLIP)))
