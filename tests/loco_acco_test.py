"""ACCO inside the LoCo workers (``loco.inner = acco``) against a reference written here.

Each worker of the reference runs ACCO on whole parameter trees, from the formulas of
:func:`acco_jax.acco` and the stage schedule of :mod:`acco_jax.dp.stage` (docs/design.md, "ACCO
inside the workers"): an inner step is one round, an estimate then a commit,

  θ̃ = θ + Opt(g̃ / ñ; S)          (S discarded)         g  = Σ ∇f(θ, ξ),  ξ in the first half
  θ ← θ + Opt((g̃ + g) / (ñ + n); S)  (S updated)        g̃ ← Σ ∇f(θ̃, ξ), ξ in the second half

where "half" is of each of the worker's devices' ``k`` microbatches, the sums run over the worker's
``D`` devices, and the first ``g̃`` is one microbatch per device at ``θ_0`` (so the counts are
uneven: ``ñ = D`` then ``D k/2``; ``n = D k/2``). The outer steps are ``loco_overlap_test``'s
reference (blocking and eager); a sync reads the committed ``θ_m`` and sets it, and the buffer
``g̃`` is kept across it (taken at the estimate before the sync, it enters the first round after).
The inner optimizer clips each worker's gradient to a global norm it always exceeds, then SGD with
momentum (a linear step after the clip, as ``loco_overlap_test`` explains).

Two other references guard the test: the buffer's policy flipped (``g̃`` taken anew at the synced
weights over the same microbatches) and the sync reading the last estimate ``θ̃`` instead of the
commit; on every leaf each is at least 10 tolerances from the reference (measured: 16 to 67 for
the flipped buffer, more for the estimate), so a library doing either fails.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acco_jax
from acco_jax import loco
from acco_jax.analysis import dataflow
from tests.loco_overlap_test import UPDATE_RTOL, ref_overlap, relative_gap, updates_close, workers
from tests.loco_test import B, run, toy_batches, toy_loss, toy_params

M, D, H, K = 2, 4, 2, 4  # workers, devices per worker, inner steps per sync, microbatches per step
CLIP = 0.05
grad = jax.jit(jax.grad(toy_loss))


def inner():
  return optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(0.5, momentum=0.9))


def tree_sum(trees):
  return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *trees)


class AccoWorkers:
  """Each worker's ACCO rounds (module docstring). ``policy``: 'keep' (the library's), or
  'restart' (``g̃`` recomputed at the synced weights); ``read``: 'commit' (the library's) or
  'estimate' (a sync sees the last ``θ̃``)."""

  def __init__(self, params, prime, policy="keep", read="commit"):
    self.tx, self.policy, self.read = inner(), policy, read
    self.S = [self.tx.init(params)] * M
    self.committed, self.estimate = [params] * M, [params] * M
    self.kept, self.last, self.norms = [], [], []
    for m in range(M):  # one microbatch per device at θ_0
      mbs = [
        jax.tree.map(lambda x, i=i: x[i * B : (i + 1) * B], prime)
        for i in range(m * D, (m + 1) * D)
      ]
      self.kept.append((tree_sum([grad(params, mb) for mb in mbs]), D))
      self.last.append(mbs)

  @property
  def theta(self):
    return self.estimate if self.read == "estimate" else self.committed

  def halves(self, batch, m):
    """Worker m's microbatches: (the first k/2 of each device's, the last k/2 of each's)."""
    rows = batch["x"].shape[0] // M
    own = jax.tree.map(lambda x: x[m * rows : (m + 1) * rows], batch)
    mbs = [jax.tree.map(lambda x, j=j: x[j * B : (j + 1) * B], own) for j in range(D * K)]
    device = [mbs[d * K : (d + 1) * K] for d in range(D)]
    return [mb for dev in device for mb in dev[: K // 2]], [
      mb for dev in device for mb in dev[K // 2 :]
    ]

  def step(self, m, batch):
    first, second = self.halves(batch, m)
    theta, (g_kept, n_kept) = self.committed[m], self.kept[m]
    mean = lambda g, n: jax.tree.map(lambda x: x / n, g)
    est = optax.apply_updates(theta, self.tx.update(mean(g_kept, n_kept), self.S[m], theta)[0])
    g = tree_sum([grad(theta, mb) for mb in first])
    total = jax.tree.map(lambda a, b: a + b, g_kept, g)
    self.norms.append(float(optax.tree.norm(mean(total, n_kept + len(first)))))
    upd, self.S[m] = self.tx.update(mean(total, n_kept + len(first)), self.S[m], theta)
    self.committed[m], self.estimate[m] = optax.apply_updates(theta, upd), est
    self.kept[m] = (tree_sum([grad(est, mb) for mb in second]), len(second))
    self.last[m] = second

  def move(self, m, theta):
    self.committed[m] = self.estimate[m] = theta
    if self.policy == "restart":
      self.kept[m] = (tree_sum([grad(theta, mb) for mb in self.last[m]]), len(self.last[m]))


def run_acco(mode, batches, prime):
  method = loco.diloco(sync_every=H, outer_overlap=mode)
  tx = acco_jax.acco(inner(), comm_dtype=jnp.float32)
  return run(method, M, D, batches, tx, k=K, prime=prime)


@pytest.mark.slow  # ~40 s each: three syncs of 2 x 4 devices against the reference
@pytest.mark.parametrize("mode", ["none", "eager"])
def test_acco_inner_matches_reference_three_syncs(mode):
  batches = toy_batches(3 * H, M * D * K * B)
  prime = toy_batches(1, M * D * B, seed=7)[0]
  train, state, logged = run_acco(mode, batches, prime)
  ref = AccoWorkers(toy_params(), prime)
  glob, theta = ref_overlap(toy_params(), batches, M, D, H, mode, workers=ref)
  assert min(ref.norms) > CLIP  # the clip acts at every commit
  updates_close(train.params(state), glob)
  for m, got in enumerate(workers(train, state)):
    updates_close(got, theta[m])
  assert all(bool(np.all(r["committed"])) for r in logged)  # every inner step ends on a commit
  assert [float(np.sum(r["microbatches"])) for r in logged[:2]] == [M * D * K] * 2
  for policy, read in (("restart", "commit"), ("keep", "estimate")):
    other = AccoWorkers(toy_params(), prime, policy, read)
    glob_other, _ = ref_overlap(toy_params(), batches, M, D, H, mode, workers=other)
    assert relative_gap(glob, glob_other, toy_params()) > 10 * UPDATE_RTOL, (policy, read)


def test_no_collective_on_the_loops_within_or_across_workers():
  """Across workers, the eager phase program with ACCO inner steps: no collective over ``replica``
  reads or feeds a microbatch loop. Within a worker, one ACCO stage as the workers run it (every
  leaf with its worker dimension): its two loops and its reduce-scatter and all-gather over
  ``data`` are independent both ways, as the data-parallel ACCO's (``tests/step_test.py``); the
  stages of a round are chained by design (a stage reduces what the one before accumulated)."""
  from acco_jax.loco import programs
  from acco_jax.loco import step as loco_step

  tx = acco_jax.acco(inner(), comm_dtype=jnp.float32)
  train = loco_step.make_loco_step(
    toy_loss,
    tx,
    loco.diloco(sync_every=H, outer_overlap="eager"),
    loco_step.worker_mesh(M, jax.devices()[: M * D]),
    num_microbatches=K,
    params=toy_params(),
  )
  state = train.init(toy_params(), toy_batches(1, M * D * B, seed=7)[0])
  batches = [train.put_batch(b) for b in toy_batches(H, M * D * K * B)]
  jaxpr = jax.make_jaxpr(train.program("phase", 0, state))(state, batches)
  across = dataflow.dataflow_report(jaxpr, psum_limit=16, axis="replica", loops_with="dot_general")
  assert across.loops >= 2 and not across.loop_feeds_comm and not across.comm_feeds_loop
  stage = train.inner.program.stage_fn("delayed")
  half = programs._halves(train, programs._per_worker_batch(train, batches[0]))[0]
  within = dataflow.dataflow_report(
    jax.make_jaxpr(lambda s, b: stage(s, b, None))(state.inner, half), psum_limit=16, axis="data"
  )
  assert within.loops == 2 and within.collectives_in_loop == () and within.large_psums == ()
  assert within.overlappable


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=pytest.mark.slow)
    for n in ("streaming_diloco", "noloco", "sparseloco_eager", "demo")
  ],
)
def test_every_loco_method_trains_with_acco_inside(tmp_path, name):
  """Through the trainer, tiny preset, 8 devices: Streaming DiLoCo's fragments (a window of tau
  steps with its reduction in flight, applied a call later), NoLoCo's pair exchange, SparseLoCo's
  sparse gather under eager overlap, DeMo's kept gradient (ACCO's commit's) synced every step."""
  from acco_jax.run import trainer
  from configs import gpt2_demo, gpt2_noloco, gpt2_sparseloco, gpt2_streaming_diloco
  from tests.loco_train_test import tiny

  module, extra = {
    "streaming_diloco": (gpt2_streaming_diloco, {"loco.overlap_steps": 1}),
    "noloco": (gpt2_noloco, {}),
    "sparseloco_eager": (gpt2_sparseloco, {"loco.outer_overlap": "eager"}),
    "demo": (gpt2_demo, {}),
  }[name]
  # one block (Streaming's two fragments need two): the compiles are most of this test's time
  blocks = {"model.N": 2 if name == "streaming_diloco" else 1}
  config = tiny(module, **{"loco.inner": "acco", **blocks, **extra})
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  assert summary["stages"] == config.train.num_updates and summary["wire_bytes_per_worker"] > 0
  assert np.isfinite(summary["eval_loss"]) and summary["eval_loss"] < np.log(257) - 0.4, summary
