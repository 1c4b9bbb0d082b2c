"""The 8-device step against single-device references of each method, written here from the algorithm.

The references use plain jnp on whole pytrees (no shard_map, no flat layout): they follow
``acco-algorithm.md`` §3-§6 directly, so a bookkeeping error in the library shows up as a mismatch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acco_jax

N = 8  # devices (tests/conftest.py)
K = 2  # microbatches per device per stage
B = 3  # rows per microbatch


def init_params(seed=0):
  r = np.random.default_rng(seed)
  return {  # sizes not divisible by 8, to exercise padding
    "hidden": {"kernel": r.normal(size=(5, 7)) * 0.5, "bias": np.zeros(7)},
    "out": {"kernel": r.normal(size=(7, 3)) * 0.5, "bias": np.zeros(3)},
    "scale": np.ones(3),
  }


def as_f32(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def loss_fn(p, mb):
  h = jnp.tanh(mb["x"] @ p["hidden"]["kernel"] + p["hidden"]["bias"])
  y = (h @ p["out"]["kernel"] + p["out"]["bias"]) * p["scale"]
  return jnp.mean((y - mb["y"]) ** 2)


def make_batches(num_stages, seed=1, k=K):
  r = np.random.default_rng(seed)
  out = []
  for _ in range(num_stages):
    x = r.normal(size=(N * k * B, 5)).astype(np.float32)
    y = np.sin(x[:, :3] * 2.0).astype(np.float32) + 0.1 * r.normal(size=(N * k * B, 3))
    out.append({"x": x, "y": y.astype(np.float32)})
  return out


def first_microbatch(seed=2):
  r = np.random.default_rng(seed)
  x = r.normal(size=(N * B, 5)).astype(np.float32)
  return {"x": x, "y": np.cos(x[:, :3]).astype(np.float32)}


def device_microbatches(batch, i, k=K):
  """Device i's microbatches of a stage batch (device-major blocks of k*B rows)."""
  block = jax.tree.map(lambda x: x[i * k * B : (i + 1) * k * B], batch)
  return [jax.tree.map(lambda x, j=j: x[j * B : (j + 1) * B], block) for j in range(k)]


grad = jax.jit(jax.grad(loss_fn))


def tree_sum(trees):
  return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *trees)


def local_sums(w, batch, counts, k=K):
  """Per device: sum of gradients at w over its first counts[i] microbatches."""
  sums = []
  for i in range(N):
    mbs = device_microbatches(batch, i, k)[: counts[i]]
    sums.append(tree_sum([grad(w, mb) for mb in mbs]))
  return sums


def mean_of(sums, counts):
  return jax.tree.map(lambda x: x / float(sum(counts)), tree_sum(sums))


def opt_step(inner, g, state, params):
  u, new_state = inner.update(g, state, params)
  return optax.apply_updates(params, u), new_state


# -- references ---------------------------------------------------------------------------------


def ref_acco(inner, params, init_mb, batches, counts_per_stage):
  """acco-algorithm.md §3/§4.5: estimate (discard state) / commit (keep), accumulator kept after commits."""
  theta, S = params, inner.init(params)
  init_sums = [grad(params, device_microbatches(init_mb, i, 1)[0]) for i in range(N)]
  buf, buf_n = init_sums, [1] * N
  w, committed_after = params, []
  for c, (batch, counts) in enumerate(zip(batches, counts_per_stage, strict=True)):
    g = mean_of(buf, buf_n)
    target, S_new = opt_step(inner, g, S, theta)
    new_sums = local_sums(w, batch, counts)
    if c % 2 == 0:  # estimate: θ̃ from (θ, S); accumulator continues on top of the shipped buffer
      acc = [tree_sum([a, s]) for a, s in zip(buf, new_sums, strict=True)]
      acc_n = [n + m for n, m in zip(buf_n, counts, strict=True)]
    else:  # commit: θ, S advance; accumulator restarts (it held g̃ + g, now ships it)
      theta, S = target, S_new
      acc, acc_n = new_sums, list(counts)
      committed_after.append(theta)
    buf, buf_n, w = acc, acc_n, target
  return theta, w, committed_after


def ref_sync(inner, params, batches, counts_per_stage):
  """DDP / ZeRO-1: θ_{t+1} = Opt(θ_t, mean grad at θ_t)."""
  theta, S = params, inner.init(params)
  for batch, counts in zip(batches, counts_per_stage, strict=True):
    theta, S = opt_step(inner, mean_of(local_sums(theta, batch, counts), counts), S, theta)
  return theta


def ref_dpu(inner, params, init_mb, batches, counts_per_stage, warmup=0):
  """θ_{t+1} = Opt(θ_t, mean grad at θ_{t-1}); buffer reset every stage; W synchronous steps first."""
  theta, S = params, inner.init(params)
  buf = buf_n = None
  if warmup == 0:
    buf = [grad(params, device_microbatches(init_mb, i, 1)[0]) for i in range(N)]
    buf_n = [1] * N
  for c, (batch, counts) in enumerate(zip(batches, counts_per_stage, strict=True)):
    sums = local_sums(theta, batch, counts)
    if c < warmup:
      theta, S = opt_step(inner, mean_of(sums, counts), S, theta)
      continue
    if c == warmup and warmup > 0:  # fill the pipeline at θ_W, no update
      buf, buf_n = sums, list(counts)
      continue
    theta_next, S = opt_step(inner, mean_of(buf, buf_n), S, theta)
    buf, buf_n, theta = sums, list(counts), theta_next
  return theta


def ref_wp(inner, params, init_mb, batches, counts_per_stage):
  """Commit θ_{t+1} = Opt(θ_t, ḡ); compute the next gradients at θ̂ = Opt(θ_{t+1}, ḡ) (state discarded)."""
  theta, S = params, inner.init(params)
  buf = [grad(params, device_microbatches(init_mb, i, 1)[0]) for i in range(N)]
  buf_n, w = [1] * N, params
  for batch, counts in zip(batches, counts_per_stage, strict=True):
    g = mean_of(buf, buf_n)
    theta, S = opt_step(inner, g, S, theta)
    predicted, _ = opt_step(inner, g, S, theta)
    buf, buf_n, w = local_sums(w, batch, counts), list(counts), predicted
  return theta, w


# -- helpers to run the library -----------------------------------------------------------------


def decay_mask(params):
  return {
    "hidden": {"kernel": True, "bias": False},
    "out": {"kernel": True, "bias": False},
    "scale": False,
  }


def inner_optimizer(params):
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 3, 30, 3e-3)
  return optax.chain(
    optax.clip_by_global_norm(0.5),
    optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask(params)),
  )


def run_library(tx, params, batches, counts_per_stage, k=K):
  mesh = jax.make_mesh((N,), ("data",))
  train = acco_jax.make_train_step(loss_fn, tx, mesh, num_microbatches=k, params=params)
  state = train.init(params, first_microbatch())
  for batch, counts in zip(batches, counts_per_stage, strict=True):
    state, _ = train.step(state, batch, counts)
  return train, state


def assert_trees_close(a, b, rtol=2e-5, atol=2e-6):
  for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
    )


def assert_updates_close(got, want, start, rtol):
  """Per leaf: ``max|got − want| <= rtol · max|want − start|``, a tolerance on the update from
  ``start`` (not on the parameters: their size says nothing about how far a step moved them). Each
  leaf must have moved by at least 20 float32 ulps of its values over ``rtol``: rounding
  ``θ + u``, which both sides do, then stays below 1/20 of the tolerance, and a leaf that barely
  moved cannot pass by its rounding alone."""
  for (path, x), y, s in zip(
    jax.tree.leaves_with_path(got), jax.tree.leaves(want), jax.tree.leaves(start), strict=True
  ):
    x, y, s = (np.asarray(v, np.float64) for v in (x, y, s))
    size = np.max(np.abs(y - s))
    ulp = np.finfo(np.float32).eps * max(np.max(np.abs(s)), np.max(np.abs(y)))
    where = jax.tree_util.keystr(path)
    assert rtol * size >= 20 * ulp, f"{where} moved by {size:.2e} only: its rounding is the test"
    np.testing.assert_allclose(x, y, rtol=0, atol=rtol * size, err_msg=where)


FULL = [K] * N
UNEQUAL = [1, 2, 2, 1, 2, 1, 1, 2]


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("counts", [FULL, UNEQUAL], ids=["equal", "unequal"])
def test_acco_matches_reference_adamw_clip_mask(counts):
  params = as_f32(init_params())
  stages = 20  # 10 updates
  batches = make_batches(stages)
  inner = inner_optimizer(params)
  train, state = run_library(
    acco_jax.acco(inner, comm_dtype=jnp.float32), params, batches, [counts] * stages
  )
  theta, w, _ = ref_acco(inner, params, first_microbatch(), batches, [counts] * stages)
  assert_trees_close(train.params(state), theta)
  assert_trees_close(train.compute_params(state), w)


def test_zero1_equals_ddp_equals_reference():
  params = as_f32(init_params())
  batches = make_batches(10)
  inner = inner_optimizer(params)
  ref = ref_sync(inner, params, batches, [FULL] * 10)
  for method in (acco_jax.zero1, acco_jax.ddp):
    train, state = run_library(method(inner, comm_dtype=jnp.float32), params, batches, [FULL] * 10)
    assert_trees_close(train.params(state), ref)


@pytest.mark.parametrize("warmup", [0, 3])
def test_dpu_matches_reference(warmup):
  params = as_f32(init_params())
  batches = make_batches(12)
  inner = inner_optimizer(params)
  tx = acco_jax.dpu(inner, warmup_steps=warmup, comm_dtype=jnp.float32)
  train, state = run_library(tx, params, batches, [FULL] * 12)
  ref = ref_dpu(inner, params, first_microbatch(), batches, [FULL] * 12, warmup)
  assert_trees_close(train.params(state), ref)


def test_dpu_warmup_reads_the_stage_from_the_device_once(monkeypatch):
  """Which stage kind runs (sync, fill, delayed) follows the stage count: the step keeps it on the
  host for the state it returned, so only the first call reads it from the device."""
  import acco_jax.dp.step as step_module

  params = as_f32(init_params())
  tx = acco_jax.dpu(optax.sgd(0.1), warmup_steps=2, comm_dtype=jnp.float32)
  mesh = jax.make_mesh((N,), ("data",))
  train = acco_jax.make_train_step(loss_fn, tx, mesh, num_microbatches=K, params=params)
  state = train.init(params, first_microbatch())
  reads = []
  get = jax.device_get
  monkeypatch.setattr(step_module.jax, "device_get", lambda x: reads.append(x) or get(x))
  for batch in make_batches(5):
    state, _ = train.step(state, batch)
  assert len(reads) == 1 and int(get(state.stage)) == 5
  copy = jax.tree.map(lambda x: x + 0 if x.dtype == jnp.int32 and x.ndim == 0 else x, state)
  train.step(copy, make_batches(1)[0])  # a state the step did not return: read again
  assert len(reads) == 2


def test_wp_matches_reference():
  params = as_f32(init_params())
  batches = make_batches(10)
  inner = inner_optimizer(params)
  train, state = run_library(
    acco_jax.wp(inner, comm_dtype=jnp.float32), params, batches, [FULL] * 10
  )
  theta, w = ref_wp(inner, params, first_microbatch(), batches, [FULL] * 10)
  assert_trees_close(train.params(state), theta)
  assert_trees_close(train.compute_params(state), w)


def test_methods_differ_from_each_other():
  """Guards the references: the delayed methods really differ from the synchronous one."""
  params = as_f32(init_params())
  batches = make_batches(8)
  inner = optax.sgd(0.3)
  sync = ref_sync(inner, params, batches, [FULL] * 8)
  dpu = ref_dpu(inner, params, first_microbatch(), batches, [FULL] * 8)
  acco, _, _ = ref_acco(inner, params, first_microbatch(), batches, [FULL] * 8)
  diff = lambda a, b: max(
    float(jnp.max(jnp.abs(x - y))) for x, y in zip(*map(jax.tree.leaves, (a, b)), strict=True)
  )
  assert diff(sync, dpu) > 1e-3 and diff(sync, acco) > 1e-3 and diff(acco, dpu) > 1e-3
