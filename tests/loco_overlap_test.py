"""Delayed and eager outer updates (``loco.outer_overlap``) against a reference written here.

The reference follows :mod:`acco_jax.loco.overlap`'s formulas on whole parameter trees, with the
outer Nesterov SGD written out (``u ← μ u + Δ``, ``C ← C − η (Δ + μ u)``); the workers' inner steps
are those of ``tests/loco_test.py``'s reference, with another inner optimizer:

The workers' inner optimizer here is SGD with momentum, not ``loco_test``'s AdamW with a global-norm
clip: the overlap's algebra (which average is applied, estimated and committed when) is the outer
step's and the same under any inner optimizer, and a linear inner step carries the float noise of
the gradient sums (their order is XLA's choice, per CPU) through the ten steps without ``g /
sqrt(v)`` amplifying it. Comparisons are of updates, ``θ − θ_0``, at ``UPDATE_RTOL`` of the
reference's update per leaf (``tests.methods_test.assert_updates_close``). Measured here with an
extra absolute noise of ``1e-6 max|g|`` on every worker's gradient (six times what reordering a
float32 sum of n terms changes, about ``√n · 6e-8`` of their size: ``1.7e-7`` for a worker's 8
rows): the references move by at most ``5e-6`` of their update over the three syncs, and the
library is within ``5e-7`` of them (here and with XLA generating SSE4.2 code at optimisation level
3, .ci/run); ``UPDATE_RTOL = 1e-4`` keeps a margin of 20 over that noise.
The three modes' references differ by at least ``6e-2`` of the update (asserted: at least 100
tolerances), so a library running another mode, or one that drops a term of the estimate or the
late commit, fails.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acco_jax
from acco_jax import loco
from acco_jax.analysis import dataflow
from acco_jax.loco import base
from acco_jax.loco import step as loco_step
from tests.loco_test import (
  B,
  K,
  assert_trees_close,
  run,
  toy_batches,
  toy_loss,
  toy_params,
  worker_grad,
)
from tests.methods_test import assert_updates_close

LR, MU = 0.7, 0.9
UPDATE_RTOL = 1e-4  # of the reference's update, per leaf (module docstring)


def inner_sgd():
  """The workers' inner optimizer (module docstring)."""
  return optax.sgd(0.02, momentum=0.9)


def inner_tx(name="zero1"):
  return acco_jax.get_method(name, inner_sgd(), comm_dtype=jnp.float32)


def updates_close(got, want, start=None, rtol=UPDATE_RTOL):
  assert_updates_close(got, want, toy_params() if start is None else start, rtol)


def relative_gap(a, b, start):
  """The smallest over leaves of ``max|a − b| / max|a − start|``."""
  gaps = [
    float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(x - s)))
    for x, y, s in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(start), strict=True)
  ]
  return min(gaps)


def outer(c, u, d):
  """Nesterov SGD (DiLoCo's outer optimizer): returns ``(C', u')``."""
  u = jax.tree.map(lambda a, b: MU * a + b, u, d)
  return jax.tree.map(lambda x, g, v: x - LR * (g + MU * v), c, d, u), u


class SgdWorkers:
  """The workers' inner steps of the reference: each its optimizer (:func:`inner_sgd`) on the mean
  gradient of its microbatches. ``theta[m]`` is worker ``m``'s parameters; a sync sets them with
  :meth:`move`."""

  def __init__(self, params, M, D):
    self.tx, self.M, self.D = inner_sgd(), M, D
    self.theta, self.opt = [params] * M, [self.tx.init(params)] * M

  def step(self, m, batch):
    g = worker_grad(self.theta[m], batch, m, self.M, self.D)
    upd, self.opt[m] = self.tx.update(g, self.opt[m], self.theta[m])
    self.theta[m] = jax.tree.map(lambda a, b: a + b, self.theta[m], upd)

  def move(self, m, theta):
    self.theta[m] = theta


def ref_overlap(params, batches, M, D, H, mode, workers=None):
  """DiLoCo with ``mode`` = none | delayed | eager: Δ_m(t) = s_m(t−1) − θ_m(t) at every sync t.

  none: blocking, every worker starts from C(t) = Outer(C(t−1), Δ̄(t)). delayed: the average is
  committed one sync later and every worker starts from the committed model. eager: each worker
  takes its own outer step on Δ̃_m(t) = Δ̄(t−1) − Δ_m(t−1)/M + Δ_m(t)/M
  (its own outer parameters and momentum) and starts from it. The sync no phase follows blocks
  (eager: its step uses Δ̄(T) for the own fresh share). ``workers``: the inner steps (default
  :class:`SgdWorkers`). Returns worker 0's outer parameters and the workers' parameters.
  """
  w = workers or SgdWorkers(params, M, D)
  zeros = jax.tree.map(jnp.zeros_like, params)
  start, c, u = [params] * M, [params] * M, [zeros] * M  # eager: per worker; else all equal
  last_mean, last_own, pending = zeros, [zeros] * M, None
  avg = lambda xs: jax.tree.map(lambda *v: sum(v[1:], v[0]) / len(v), *xs)
  for s, batch in enumerate(batches):
    for m in range(M):
      w.step(m, batch)
    theta = w.theta
    done = s + 1
    if done % H:
      continue
    deltas = [jax.tree.map(lambda a, b: a - b, start[m], theta[m]) for m in range(M)]
    mean = avg(deltas)
    last = done + H > len(batches)  # no phase follows: blocking
    for m in range(M):
      if mode == "none":
        c[m], u[m] = outer(c[m], u[m], mean)
      elif mode == "eager":
        fresh = mean if last else jax.tree.map(lambda f: f / M, deltas[m])
        est = jax.tree.map(lambda a, o, f: a - o / M + f, last_mean, last_own[m], fresh)
        c[m], u[m] = outer(c[m], u[m], est)
      else:
        if pending is not None:  # the reduction issued one sync ago lands now
          c[m], u[m] = outer(c[m], u[m], pending)
        if last:
          c[m], u[m] = outer(c[m], u[m], mean)
      start[m] = c[m]
      w.move(m, c[m])
    last_mean, last_own, pending = mean, deltas, mean
    if last:
      last_mean, last_own, pending = zeros, [zeros] * M, None
  return c[0], w.theta


def workers(train, state):
  out = train.worker_params(state)
  return [jax.tree.map(lambda x, m=m: np.asarray(x[m]), out) for m in range(train.num_workers)]


@pytest.mark.parametrize(
  "mode,steps",
  [
    ("eager", 9),
    ("delayed", 10),
    pytest.param("eager", 10, marks=pytest.mark.slow),
    pytest.param("delayed", 9, marks=pytest.mark.slow),
  ],
)  # (the slow variants run in .ci/run's slow step: the README command's time is bounded)
def test_matches_reference_three_syncs_four_workers(mode, steps):
  """3 syncs of 4 workers x 2 devices (and a tail step after the last one). Every term moves the
  result: the second sync's phase commits the first average (delayed) or estimates with all three
  terms (eager), and the last sync blocks."""
  M, D, H = 4, 2, 3
  batches = toy_batches(steps, M * D * K * B)
  train, state, logged = run(
    loco.diloco(sync_every=H, outer_overlap=mode), M, D, batches, inner_tx()
  )
  glob, theta = ref_overlap(toy_params(), batches, M, D, H, mode)
  updates_close(train.params(state), glob)
  for m, got in enumerate(workers(train, state)):
    updates_close(got, theta[m])
  assert [int("outer_fragment" in r) for r in logged][:4] == [
    0,
    0,
    0,
    1,
  ]  # 1, 1, phase, phase+flush
  # the reference tells the mode from the others, by far more than the tolerance
  for other in {"none", "delayed", "eager"} - {mode}:
    ref_other, _ = ref_overlap(toy_params(), batches, M, D, H, other)
    assert relative_gap(glob, ref_other, toy_params()) > 100 * UPDATE_RTOL, other


@pytest.mark.slow
def test_eager_ddp_inner_matches_reference():
  M, D, H = 2, 4, 2
  batches = toy_batches(6, M * D * K * B)
  method = loco.diloco(sync_every=H, outer_overlap="eager")
  train, state, _ = run(method, M, D, batches, inner_tx("ddp"))
  glob, _ = ref_overlap(toy_params(), batches, M, D, H, "eager")
  updates_close(train.params(state), glob)


ONE_WORKER = {
  "diloco": lambda mode: loco.diloco(sync_every=3, outer_overlap=mode),
  "streaming_fp4": lambda mode: loco.streaming_diloco(
    sync_every=4,
    fragments=2,
    overlap_steps=0,
    alpha=0.5,
    quantize="fp4",
    block=16,
    outer_overlap=mode,
  ),
  "sparseloco": lambda mode: loco.sparseloco(2, topk=4, chunk=4, bits=2, outer_overlap=mode),
}


@pytest.mark.parametrize(
  "name",
  [n if n == "diloco" else pytest.param(n, marks=pytest.mark.slow) for n in ONE_WORKER],
)  # Streaming DiLoCo and SparseLoCo compile many programs: .ci/run's slow step runs them
def test_one_worker_eager_is_blocking(name):
  """M = 1: Δ̃ = Δ̄(t), the estimate is the commit (per fragment for Streaming DiLoCo; the decoded
  sparse share for SparseLoCo, whose error feedback then sees the same Δ). Float tolerance (other
  programs), on the update. The quantized variants round Δ to a grid: the two runs agree to the
  last bit here (with SSE4.2 code too); a last-bit difference would move a value across a grid point
  with a probability of about 1e-6 per element and sync."""
  batches = toy_batches(10, 8 * K * B)
  train, state, _ = run(ONE_WORKER[name]("eager"), 1, 8, batches, inner_tx())
  none, ref_state, _ = run(ONE_WORKER[name]("none"), 1, 8, batches, inner_tx())
  updates_close(train.params(state), none.params(ref_state))
  updates_close(workers(train, state)[0], workers(none, ref_state)[0])


def test_identical_data_eager_start_point_identity():
  """Every worker given the same rows: all Δ_m are equal, the workers stay identical and eager is
  blocking DiLoCo on the others' share one sync late and its own now,
  s(t) = C(t) = Outer(C(t−1), (1 − 1/M) Δ(t−1) + Δ(t)/M; u(t−1)) with Δ(t) = s(t−1) − θ(t), C and
  u read from the state before and after each phase (all but the last, whose sync then blocks)."""
  M, D, H = 4, 2, 2
  one = toy_batches(10, D * K * B)
  batches = [jax.tree.map(lambda x: np.concatenate([x] * M), b) for b in one]
  train, state = build(loco.diloco(sync_every=H, outer_overlap="eager"), M, D)
  full = lambda x: jax.tree.map(lambda v: np.asarray(v)[0], jax.vmap(train.layout.from_shards)(x))
  view = lambda d: full(base.replace(state.overlap.start, d))  # an outer-state view as a tree
  s, total, d_prev, checked = 0, len(batches), None, 0
  while s < total:
    call = train.schedule(s, total)
    if call.phase is not None:
      theta, s_prev = workers(train, state)[0], full(state.overlap.start)
      c, u = full(state.outer.params), view(state.outer.opt[0][0].trace)
    state, _ = train.call(state, batches[s : s + call.stages], s, total)
    s += call.stages
    if call.phase is None or call.sync is not None:  # (the run's last phase is then flushed)
      continue
    delta = jax.tree.map(lambda a, b: a - b, s_prev, theta)
    d_prev = d_prev or jax.tree.map(np.zeros_like, delta)
    est = jax.tree.map(lambda a, b: (1 - 1 / M) * a + b / M, d_prev, delta)
    want = outer(c, u, est)[0]
    starts = jax.vmap(train.layout.from_shards)(state.overlap.start)
    # one outer step from the library's own state, the same float32 arithmetic on both sides: they
    # differ by its rounding only (a few ulps of C), the step by ~1e-2 (dropping a term of the
    # estimate moves it by 1/M of itself)
    for m in range(M):
      updates_close(jax.tree.map(lambda x, m=m: x[m], starts), want, c, rtol=1e-3)
    d_prev, checked = delta, checked + 1
  assert checked == 3
  ws = workers(train, state)
  for w in ws[1:]:
    assert_trees_close(w, ws[0], rtol=0, atol=0)


def build(method, M, D, inner="zero1"):
  mesh = loco_step.worker_mesh(M, jax.devices()[: M * D])
  train = loco_step.make_loco_step(
    toy_loss, inner_tx(inner), method, mesh, num_microbatches=K, params=toy_params()
  )
  return train, train.init(toy_params())


PHASED = {
  "diloco": lambda: loco.diloco(sync_every=2, outer_overlap="eager"),
  "streaming_fp4": lambda: ONE_WORKER["streaming_fp4"]("eager"),
  "sparseloco": lambda: ONE_WORKER["sparseloco"]("eager"),
}


@pytest.mark.parametrize(
  "name", [n if n == "diloco" else pytest.param(n, marks=pytest.mark.slow) for n in PHASED]
)
def test_phase_program_reduction_and_inner_steps_are_independent(name):
  """The schedule check: in the phase program no collective over the workers depends on an inner
  step's loop or feeds one (so the reduction can be in flight across all of them). The control,
  the blocking sync composed after one inner step, is told apart (its reduction reads the loop).

  Loops count when they multiply matrices (``loops_with="dot_general"``): the inner steps'
  microbatch loops and the loop over the phase's steps, not SparseLoCo's decode, which adds the
  all-gathered sparse rows one worker at a time in a loop that reads the collective by design
  (it is the reduction's own arithmetic: the average the commit takes after the steps)."""
  M, D = 4, 2
  train, state = build(PHASED[name](), M, D)
  k = train.method.period
  batches = [train.put_batch(b) for b in toy_batches(k, M * D * K * B)]
  fn = train.program("phase", 0, state)
  report = dataflow.dataflow_report(
    jax.make_jaxpr(fn)(state, batches),
    psum_limit=16,
    axis="replica",
    loops_with="dot_general",
  )
  assert report.loops >= 2  # the first step's microbatch loop, the loop over the others
  assert not report.loop_feeds_comm and not report.comm_feeds_loop
  stage, flush = train.program("stage", None, state), train.program("flush", 0, state)
  control = lambda s, b: flush(stage(s, b)[0])
  blocking = dataflow.dataflow_report(
    jax.make_jaxpr(control)(state, batches[0]),
    psum_limit=16,
    axis="replica",
    loops_with="dot_general",
  )
  assert blocking.loops >= 1 and blocking.loop_feeds_comm


def test_outer_overlap_refusals():
  with pytest.raises(ValueError, match=r"not to noloco; set loco.outer_overlap='none'"):
    base.check(
      loco.LocoMethod(
        "noloco", 2, loco.default_outer(), pairing=base.Pairing(), outer_overlap="eager"
      )
    )
  with pytest.raises(ValueError, match=r"set loco.overlap_steps=0"):
    loco.streaming_diloco(4, 2, overlap_steps=1, outer_overlap="delayed")
  with pytest.raises(ValueError, match=r"choose one of none, delayed, eager"):
    loco.diloco(2, outer_overlap="later")
