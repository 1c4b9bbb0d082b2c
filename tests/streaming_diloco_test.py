"""Streaming DiLoCo against ``loco_test``'s reference (loco-family.md §2): fragments synced in
turn, each reduction in flight for τ inner steps and merged with α, FP4; the in-flight state it
checkpoints and the bytes a sync moves between workers."""

import jax
import jax.numpy as jnp
import pytest

import acco_jax
from acco_jax import loco
from acco_jax.loco import base
from acco_jax.loco import step as loco_step
from tests.loco_test import (
  B,
  K,
  assert_trees_close,
  inner_opt,
  ref_loco,
  run,
  strided_fragments,
  toy_batches,
  toy_loss,
  toy_params,
)

# -- Streaming DiLoCo ------------------------------------------------------------------------------


def test_fragments_strided_and_sequential():
  params = toy_params()
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  strided = base.partition(params, 2, "strided")
  frag = strided_fragments(2)
  expected = [frag(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert [
    next(f for f, idx in enumerate(strided) if i in idx) for i in range(len(paths))
  ] == expected
  sequential = base.partition(params, 2, "sequential")
  names = [[paths[i] for i in idx] for idx in sequential]
  assert all(
    "['blocks']['0']" in n or "['blocks']['1']" in n or "emb" in n or "head" in n for n in names[0]
  )
  assert all("['blocks']['2']" in n or "['blocks']['3']" in n for n in names[1])
  with pytest.raises(ValueError, match="at most one fragment per block"):
    base.partition(params, 5)


@pytest.mark.parametrize("P,tau", [(2, 0), (4, 1), (2, 3)])
def test_every_fragment_once_per_h(P, tau):
  method = loco.streaming_diloco(sync_every=8, fragments=P, overlap_steps=tau, quantize="none")
  applied, sent = [], []
  for s in range(0, 33):
    if (p := base.apply_fragment(method, s)) is not None:
      applied.append((s, p))
    if (p := base.send_fragment(method, s)) is not None:
      sent.append((s + tau, p))
  for start in range(0, 25, 8):  # any window of H consecutive steps applies each fragment once
    window = [p for s, p in applied if start < s <= start + 8]
    assert sorted(window) == list(range(P))
  assert sent == ([] if tau == 0 else applied)


def test_streaming_one_fragment_no_overlap_is_diloco():
  M, D = 4, 2
  batches = toy_batches(6, M * D * K * B)
  method = loco.streaming_diloco(
    sync_every=3, fragments=1, overlap_steps=0, alpha=0.0, quantize="none"
  )
  train, state, _ = run(method, M, D, batches)
  glob, _, _ = ref_loco(toy_params(), batches, M, D, H=3)
  assert_trees_close(train.params(state), glob)


@pytest.mark.parametrize(
  "H,P,tau,alpha,quant",
  [
    pytest.param(4, 2, 1, 0.5, "fp4", marks=pytest.mark.slow),  # README time: the last one
    pytest.param(6, 2, 2, 0.0, "none", marks=pytest.mark.slow),  # covers windows, fragments and
    (8, 4, 1, 0.25, "none"),  # alpha by default (FP4's codec: compress_test)
  ],
)
def test_streaming_matches_reference(H, P, tau, alpha, quant):
  """α = 0.25 tells α θ_m + (1 − α) θ_g from its mirror image, which α = 0.5 cannot. 2H + 1 steps:
  every fragment syncs at least twice, so its outer momentum carries into a second step."""
  M, D = 2, 4
  batches = toy_batches(2 * H + 1, M * D * K * B)
  method = loco.streaming_diloco(
    sync_every=H, fragments=P, overlap_steps=tau, alpha=alpha, quantize=quant, block=16
  )
  train, state, _ = run(method, M, D, batches)
  glob, theta, _ = ref_loco(
    toy_params(), batches, M, D, H=H, P=P, tau=tau, alpha=alpha, quant=quant == "fp4", block=16
  )
  assert_trees_close(train.params(state), glob)
  workers = train.worker_params(state)
  for m in range(M):
    assert_trees_close(jax.tree.map(lambda x, m=m: x[m], workers), theta[m])


def test_overlap_applies_the_send_time_snapshot():
  """With τ > 0 the applied mean is the pseudo-gradient at the send point, not at the apply point."""
  M, D = 2, 4
  batches = toy_batches(4, M * D * K * B)
  method = loco.streaming_diloco(
    sync_every=4, fragments=1, overlap_steps=2, alpha=0.0, quantize="none"
  )
  train, state, _ = run(method, M, D, batches)
  snapshot, _, _ = ref_loco(toy_params(), batches, M, D, H=4, tau=2)
  late, _, _ = ref_loco(toy_params(), batches, M, D, H=4)  # the same sync without overlap
  assert_trees_close(train.params(state), snapshot)
  gap = max(
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(jax.tree.leaves(snapshot), jax.tree.leaves(late), strict=True)
  )
  assert gap > 1e-3  # the check can tell the two apart


def test_alpha_one_leaves_local_parameters_untouched():
  M, D = 2, 4
  batches = toy_batches(4, M * D * K * B)
  method = loco.streaming_diloco(
    sync_every=4, fragments=2, overlap_steps=1, alpha=1.0, quantize="none"
  )
  _, local, _ = ref_loco(toy_params(), batches, M, D, H=10**6)  # never synced
  train, state, _ = run(method, M, D, batches)
  workers = train.worker_params(state)
  for m in range(M):
    assert_trees_close(jax.tree.map(lambda x, m=m: x[m], workers), local[m])
  moved = [
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(
      jax.tree.leaves(train.params(state)), jax.tree.leaves(toy_params()), strict=True
    )
  ]
  assert max(moved) > 1e-3  # θ_g did move


def test_checkpoint_in_flight_state_shape():
  """A window leaves its fragment's mean in flight in the state until the next call applies it."""
  M, D = 2, 4
  batches = toy_batches(4, M * D * K * B)
  method = loco.streaming_diloco(sync_every=4, fragments=2, overlap_steps=1, quantize="none")
  mesh = loco_step.worker_mesh(M, jax.devices()[: M * D])
  tx = acco_jax.zero1(inner_opt(), comm_dtype=jnp.float32)
  train = loco_step.make_loco_step(
    toy_loss, tx, method, mesh, num_microbatches=K, params=toy_params()
  )
  state = train.init(toy_params())
  state, _ = train.call(state, batches[:1], 0, 4)  # a plain inner step
  assert train.schedule(1, 4) == loco_step.Call(apply=None, send=0, stages=1, sync=None)
  state, _ = train.call(state, batches[1:2], 1, 4)  # a window: fragment 0 sent, in flight after
  assert int(state.inflight_fragment) == 0
  assert any(float(jnp.max(jnp.abs(x))) > 0 for x in jax.tree.leaves(state.inflight))
  assert train.schedule(2, 4).apply == 0
  state, _ = train.call(state, batches[2:3], 2, 4)  # applies fragment 0 first
  assert int(state.inflight_fragment) == -1


def test_sync_moves_the_accounted_bytes_between_workers():
  """The compiled sync program's all-reduce across workers carries exactly the fragment (float32,
  each device its 1/D share): what :meth:`LocoStep.wire_bytes` accounts (a ring sends 2 (M-1)/M of
  it), with nothing else of that size crossing workers (a metric reading one worker's copy once
  doubled it)."""
  from acco_jax.analysis import hlo

  M, D = 4, 2
  mesh = loco_step.worker_mesh(M, jax.devices()[: M * D])
  method = loco.streaming_diloco(sync_every=4, fragments=2, overlap_steps=0, quantize="none")
  tx = acco_jax.zero1(inner_opt(), comm_dtype=jnp.float32)
  train = loco_step.make_loco_step(
    toy_loss, tx, method, mesh, num_microbatches=K, params=toy_params()
  )
  state = train.abstract_state(toy_params())
  for p in range(2):
    text = train.program("sync", p, state).lower(state).compile().as_text()
    across = hlo.bytes_across(text, D)
    assert across == 4 * train.fragment_sizes()[p] // D
    assert train.wire_bytes(p) == pytest.approx(2 * (M - 1) / M * D * across)
