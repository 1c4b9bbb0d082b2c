"""Workers and the outer step (DiLoCo; Streaming DiLoCo in ``streaming_diloco_test``) against references
written here.

The references run each worker with plain jnp on whole parameter trees (no mesh, no flat layout),
following ``loco-family.md`` §1-§2: worker ``m`` takes block ``m`` of each global batch and runs the
inner optimizer on the mean gradient of its microbatches; a sync averages the pseudo-gradients
``θ_g − θ_m`` of a fragment, applies the outer optimizer, and merges.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acco_jax
from acco_jax import loco
from acco_jax.loco import base, compress
from acco_jax.loco import step as loco_step

K, B = 2, 2  # microbatches per device per step, rows per microbatch


def toy_params(seed=0):
  """A model with 4 'blocks' and leaves outside them (fragment 0), sizes not divisible by 8."""
  r = np.random.default_rng(seed)
  p = {"emb": r.normal(size=(5, 6)) * 0.5, "head": r.normal(size=(6, 3)) * 0.5}
  p["blocks"] = {str(i): {"w": r.normal(size=(6, 6)) * 0.4, "b": np.zeros(6)} for i in range(4)}
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p)


def toy_loss(p, mb):
  h = mb["x"] @ p["emb"]
  for i in range(4):
    h = h + jnp.tanh(h @ p["blocks"][str(i)]["w"] + p["blocks"][str(i)]["b"])
  return jnp.mean((h @ p["head"] - mb["y"]) ** 2)


def toy_batches(num, rows, seed=1):
  r = np.random.default_rng(seed)
  out = []
  for _ in range(num):
    x = r.normal(size=(rows, 5)).astype(np.float32)
    y = np.sin(2 * x[:, :3]).astype(np.float32) + 0.1 * r.normal(size=(rows, 3)).astype(np.float32)
    out.append({"x": x, "y": y})
  return out


def inner_opt():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(2e-2, b1=0.9, b2=0.95))


# -- the reference --------------------------------------------------------------------------------

grad = jax.jit(jax.grad(toy_loss))


def worker_grad(theta, batch, m, M, D, k=K):
  """Mean gradient of worker m's D*k microbatches (its block of the global batch)."""
  rows = batch["x"].shape[0] // M
  block = jax.tree.map(lambda x: x[m * rows : (m + 1) * rows], batch)
  mbs = [jax.tree.map(lambda x, j=j: x[j * B : (j + 1) * B], block) for j in range(D * k)]
  gs = [grad(theta, mb) for mb in mbs]
  return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]) / len(xs), *gs)


def strided_fragments(P):
  """Expected fragment membership by path for the toy model: blocks l -> l mod P; others -> 0."""

  def frag(path):
    keys = [getattr(k, "key", None) for k in path]
    return int(keys[1]) % P if keys[0] == "blocks" else 0

  return frag


def rows_roundtrip(x, D, block):
  """FP4 of one leaf as the step sends it: raveled, padded into D shard rows, blocks in a row."""
  n = x.size
  chunk = -(-n // D)
  rows = np.zeros(D * chunk, np.float32)
  rows[:n] = np.asarray(x, np.float32).reshape(-1)
  q = np.asarray(compress.fp4_roundtrip(rows.reshape(D, chunk), block)[0]).reshape(-1)
  return jnp.asarray(q[:n].reshape(x.shape))


def ref_loco(
  params, batches, M, D, H, P=1, tau=0, alpha=0.0, outer=None, quant=None, block=2048, inner=None
):
  """Streaming DiLoCo as in loco-family.md §2 (DiLoCo when P = 1, τ = 0, α = 0, no quantiser);
  ``inner`` (default :func:`inner_opt`) is each worker's optimizer on whole parameter trees."""
  outer = outer or optax.sgd(0.7, momentum=0.9, nesterov=True)
  frag = strided_fragments(P)
  inner = inner or inner_opt()
  theta = [params] * M
  S = [inner.init(params)] * M
  glob = params
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  in_frag = lambda p: [frag(path) == p for path in paths]
  pick = lambda tree, p: [x for x, f in zip(jax.tree.leaves(tree), in_frag(p), strict=True) if f]
  U = [outer.init(pick(params, p)) for p in range(P)]
  K_ = H // P
  pending = {}  # apply step -> (fragment, mean Δ)
  losses = []

  def mean_delta(p):
    deltas = []
    for m in range(M):
      d = [g - t for g, t in zip(pick(glob, p), pick(theta[m], p), strict=True)]
      if quant:
        d = [rows_roundtrip(x, D, block) for x in d]
      deltas.append(d)
    return [sum(xs[1:], xs[0]) / M for xs in zip(*deltas, strict=True)]

  def apply(p, delta):
    nonlocal glob
    g_p = pick(glob, p)
    upd, U[p] = outer.update(delta, U[p], g_p)
    new = optax.apply_updates(g_p, upd)
    leaves, it = jax.tree.leaves(glob), iter(new)
    glob = jax.tree.unflatten(
      jax.tree.structure(glob),
      [next(it) if f else x for x, f in zip(leaves, in_frag(p), strict=True)],
    )
    for m in range(M):
      t_leaves, it = jax.tree.leaves(theta[m]), iter(new)
      mixed = [
        alpha * x + (1 - alpha) * next(it) if f else x
        for x, f in zip(t_leaves, in_frag(p), strict=True)
      ]
      theta[m] = jax.tree.unflatten(jax.tree.structure(glob), mixed)

  for s, batch in enumerate(batches):
    if s in pending:
      apply(*pending.pop(s))
    if tau and s + tau <= len(batches) and (s + tau) % K_ == 0 and s + tau >= K_:
      p = ((s + tau) // K_ - 1) % P
      pending[s + tau] = (p, mean_delta(p))  # the snapshot at the send point
    step_losses = []
    for m in range(M):
      rows = batch["x"].shape[0] // M
      own = {k: v[m * rows : (m + 1) * rows] for k, v in batch.items()}
      step_losses.append(float(toy_loss(theta[m], own)))
      u, S[m] = inner.update(worker_grad(theta[m], batch, m, M, D), S[m], theta[m])
      theta[m] = optax.apply_updates(theta[m], u)
    losses.append(step_losses)
    done = s + 1
    if not tau and done % K_ == 0:
      p = (done // K_ - 1) % P
      apply(p, mean_delta(p))
  if len(batches) in pending:
    apply(*pending.pop(len(batches)))
  return glob, theta, losses


# -- running the library ---------------------------------------------------------------------------


def run(method, M, D, batches, inner_name="zero1", params=None, loss=toy_loss, k=K, prime=None):
  """``prime``: an ACCO inner step's first microbatch per device (``LocoStep.init``)."""
  params = toy_params() if params is None else params
  mesh = loco_step.worker_mesh(M, jax.devices()[: M * D])
  tx = inner_name  # a method transform, or the name of one over inner_opt()
  if isinstance(inner_name, str):
    tx = acco_jax.get_method(inner_name, inner_opt(), comm_dtype=jnp.float32)
  train = loco_step.make_loco_step(loss, tx, method, mesh, num_microbatches=k, params=params)
  state, s, total, logged = train.init(params, prime), 0, len(batches), []
  while s < total:
    n = train.schedule(s, total).stages
    state, metrics = train.call(state, batches[s : s + n], s, total)
    logged.append(jax.device_get(metrics))
    s += n
  return train, state, logged


def assert_trees_close(a, b, rtol=2e-5, atol=2e-6):
  for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
    )


# -- workers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner_name", ["zero1", "ddp"])
def test_one_worker_is_todays_step(inner_name):
  """M = 1 without a sync runs the data-parallel step of acco_jax.make_train_step. Float tolerance,
  not bits: the two are different compiled programs (another mesh), summed in orders XLA picks."""
  params, batches = toy_params(), toy_batches(3, 8 * K * B)
  method = loco.diloco(sync_every=1000)
  train, state, logged = run(method, 1, 8, batches, inner_name)
  tx = acco_jax.get_method(inner_name, inner_opt(), comm_dtype=jnp.float32)
  plain = acco_jax.make_train_step(
    toy_loss, tx, jax.make_mesh((8,), ("data",)), num_microbatches=K, params=params
  )
  ref = plain.init(params)
  for batch, got in zip(batches, logged, strict=True):
    ref, m = plain.step(ref, batch)
    np.testing.assert_allclose(np.asarray(got["loss"])[0], np.asarray(m["loss"]), rtol=1e-6)
  assert_trees_close(jax.tree.map(lambda x: np.asarray(x)[0], state.inner.params), ref.params)
  assert_trees_close(np.asarray(state.inner.w)[0], ref.w)


@pytest.mark.parametrize("M,D", [(8, 1), (4, 2), (2, 4)])
def test_diloco_matches_reference(M, D):
  batches = toy_batches(6, M * D * K * B)
  train, state, logged = run(loco.diloco(sync_every=3), M, D, batches)
  glob, theta, losses = ref_loco(toy_params(), batches, M, D, H=3)
  assert_trees_close(train.params(state), glob)
  workers = train.worker_params(state)
  for m in range(M):
    assert_trees_close(jax.tree.map(lambda x, m=m: x[m], workers), theta[m])
  np.testing.assert_allclose([np.asarray(r["loss"]) for r in logged], losses, rtol=2e-5)
  assert [int("outer_fragment" in r) for r in logged] == [0, 0, 1, 0, 0, 1]


def test_diloco_one_worker_one_step_lr1_is_the_inner_optimizer():
  batches = toy_batches(4, 8 * K * B)
  method = loco.diloco(sync_every=1, outer=loco.default_outer(lr=1.0, momentum=0.0))
  train, state, _ = run(method, 1, 8, batches)
  plain = acco_jax.make_train_step(
    toy_loss,
    acco_jax.zero1(inner_opt(), comm_dtype=jnp.float32),
    jax.make_mesh((8,), ("data",)),
    num_microbatches=K,
    params=toy_params(),
  )
  ref = plain.init(toy_params())
  for batch in batches:
    ref, _ = plain.step(ref, batch)
  assert_trees_close(train.params(state), plain.params(ref), rtol=1e-6, atol=1e-7)


def test_diloco_lr1_no_momentum_is_parameter_averaging():
  M, D = 4, 2
  batches = toy_batches(3, M * D * K * B)
  method = loco.diloco(sync_every=3, outer=loco.default_outer(lr=1.0, momentum=0.0))
  train, state, _ = run(method, M, D, batches)
  _, theta, _ = ref_loco(toy_params(), batches, M, D, H=10**6)  # no sync: the workers alone
  average = jax.tree.map(lambda *xs: sum(xs[1:], xs[0]) / M, *theta)
  assert_trees_close(train.params(state), average)
  workers = train.worker_params(state)
  assert_trees_close(jax.tree.map(lambda x: x[M - 1], workers), average)


def test_pseudo_gradient_sign():
  """Workers 2 above θ_g: Δ = −2, and outer SGD(lr 1) moves θ_g up by 2 (toward the workers)."""
  glob = {"a": jnp.zeros(3)}
  local = {"a": jnp.full(3, 2.0)}
  delta = base.pseudo_gradient(glob, local)
  np.testing.assert_array_equal(delta["a"], -2.0)
  method = loco.diloco(sync_every=1, outer=optax.sgd(1.0))
  state = base.init_outer(method, glob, ((0,),))
  new, _ = base.outer_update(method, state, base.select(delta, (0,)), 0, ((0,),))
  np.testing.assert_array_equal(new.params["a"], 2.0)


def test_maxtext_golden_losses():
  """MaxText's 4-step DiLoCo check: 2 workers, a 2->1 linear model, inner SGD 0.1, outer lr 1,
  momentum 0.9 (Nesterov), sync after step 3. The expected losses are recomputed here in NumPy."""
  x = np.array([[[0.0, 1.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]])
  y = np.array([[[1.0], [2.0]], [[2.0], [3.0]]])

  # NumPy reference, float64.
  w, b = [np.array([[2.0], [1.0]])] * 2, [np.array([1.0])] * 2
  gw, gb, u_w, u_b = np.array([[2.0], [1.0]]), np.array([1.0]), np.zeros((2, 1)), np.zeros(1)
  expected = []
  for step in range(1, 5):
    losses = []
    for m in range(2):
      r = x[m] @ w[m] + b[m] - y[m]
      losses.append(np.mean(r**2))
      w[m] = w[m] - 0.1 * (2 * x[m].T @ r / 2)
      b[m] = b[m] - 0.1 * np.mean(2 * r, axis=0)
    expected.append(np.mean(losses))
    if step % 3 == 0:
      for g, us, locs in ((gw, u_w, w), (gb, u_b, b)):
        delta = np.mean([g - loc for loc in locs], axis=0)
        us[...] = 0.9 * us + delta
        g -= delta + 0.9 * us
      w, b = [gw.copy()] * 2, [gb.copy()] * 2
  np.testing.assert_allclose(expected, [1.0, 0.65, 0.4481, 0.574244], atol=1e-6)

  # The library: loss per worker on its own 2 rows; the logged loss is the mean over workers.
  params = {"w": jnp.array([[2.0], [1.0]]), "b": jnp.array([1.0])}
  loss = lambda p, mb: jnp.mean((mb["x"] @ p["w"] + p["b"] - mb["y"]) ** 2)
  batch = {"x": x.reshape(4, 2).astype(np.float32), "y": y.reshape(4, 1).astype(np.float32)}
  mesh = loco_step.worker_mesh(2, jax.devices()[:2])
  method = loco.diloco(sync_every=3, outer=optax.sgd(1.0, momentum=0.9, nesterov=True))
  tx = acco_jax.ddp(optax.sgd(0.1), comm_dtype=jnp.float32)
  train = loco_step.make_loco_step(loss, tx, method, mesh, num_microbatches=1, params=params)
  state, got = train.init(params), []
  for s in range(4):
    before = train.params(state)
    state, metrics = train.call(state, [batch], s, 4)
    got.append(float(np.mean(metrics["loss"])))
    if s in (0, 1, 3):  # no sync: θ_g untouched
      assert_trees_close(train.params(state), before, rtol=0, atol=0)
    if s == 2:  # synced: every worker holds θ_g
      workers = train.worker_params(state)
      for m in range(2):
        assert_trees_close(jax.tree.map(lambda v, m=m: v[m], workers), train.params(state), 0, 0)
  np.testing.assert_allclose(got, expected, rtol=1e-6)
