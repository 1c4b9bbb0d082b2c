"""ACCO's stage mechanics on 8 devices: the estimate-then-commit rounds on a quadratic in closed form,
what an estimate stage leaves untouched, the microbatch counts a buffer carries (§4.5), the learning
rate schedule's pace, unequal microbatch counts and bf16 communication. The methods against their
references: ``methods_test``, whose toy model and helpers these tests share.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import acco_jax
from tests.methods_test import (
  FULL,
  K,
  N,
  as_f32,
  assert_trees_close,
  device_microbatches,
  first_microbatch,
  grad,
  init_params,
  inner_optimizer,
  loss_fn,
  make_batches,
  run_library,
)


def test_sgd_quadratic_closed_form():
  """θ̃_{t+1} = θ_t − η∇f(θ̃_t),  θ_{t+1} = θ_t − (η/2)(∇f(θ_t) + ∇f(θ̃_t)) for f = ½θᵀAθ − bᵀθ."""
  A = np.diag([1.0, 3.0, 0.5, 2.0]).astype(np.float64)
  b = np.array([1.0, -2.0, 0.5, 3.0])
  eta = 0.2

  def quad_loss(p, mb):  # deterministic gradient; the data only sets the batch shape
    th = p["theta"]
    return (
      0.5 * th @ jnp.asarray(A, jnp.float32) @ th
      - jnp.asarray(b, jnp.float32) @ th
      + 0.0 * jnp.sum(mb)
    )

  params = {"theta": jnp.array([1.0, 1.0, -1.0, 2.0], jnp.float32)}
  mesh = jax.make_mesh((N,), ("data",))
  tx = acco_jax.acco(optax.sgd(eta), comm_dtype=jnp.float32)
  train = acco_jax.make_train_step(quad_loss, tx, mesh, num_microbatches=1, params=params)
  state = train.init(params, np.zeros((N, 1), np.float32))

  g = lambda th: A @ th - b
  theta = tilde = np.array([1.0, 1.0, -1.0, 2.0])
  for _ in range(6):
    tilde_next = theta - eta * g(tilde)
    theta_next = theta - eta / 2 * (g(theta) + g(tilde))
    state, m = train.step(state, np.zeros((N, 1), np.float32))  # estimate
    assert not bool(m["committed"])
    np.testing.assert_allclose(
      np.asarray(train.compute_params(state)["theta"]), tilde_next, rtol=1e-5, atol=1e-6
    )
    state, m = train.step(state, np.zeros((N, 1), np.float32))  # commit
    assert bool(m["committed"])
    np.testing.assert_allclose(
      np.asarray(train.params(state)["theta"]), theta_next, rtol=1e-5, atol=1e-6
    )
    theta, tilde = theta_next, tilde_next


def test_estimate_stage_leaves_no_trace():
  params = as_f32(init_params())
  batches = make_batches(4)
  mesh = jax.make_mesh((N,), ("data",))
  tx = acco_jax.acco(inner_optimizer(params), comm_dtype=jnp.float32)
  train = acco_jax.make_train_step(loss_fn, tx, mesh, num_microbatches=K, params=params)
  state = train.init(params, first_microbatch())
  for i, batch in enumerate(batches):
    before = jax.device_get((state.opt_state.inner_state, state.opt_state.committed))
    state, metrics = train.step(state, batch)
    after = jax.device_get((state.opt_state.inner_state, state.opt_state.committed))
    same = all(  # exact: an estimate stage must not write this state at all
      np.array_equal(x, y)
      for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )
    assert same == (i % 2 == 0), f"stage {i}: estimate must not change state, commit must"
    assert bool(metrics["committed"]) == (i % 2 == 1)


def test_accumulator_trace_counts():
  """Microbatch counts per update follow §4.5: 1+k, then 2k for every later commit."""
  params = as_f32(init_params())
  mesh = jax.make_mesh((N,), ("data",))
  tx = acco_jax.acco(optax.sgd(0.1), comm_dtype=jnp.float32)
  train = acco_jax.make_train_step(loss_fn, tx, mesh, num_microbatches=K, params=params)
  state = train.init(params, first_microbatch())
  shipped = []
  for batch in make_batches(6):
    state, _ = train.step(state, batch)
    shipped.append(int(np.asarray(state.buf_count)[0]))
  # buffer after stage c is what stage c+1 reduces: estimate stages ship g̃+g, commit stages ship g̃
  assert shipped == [1 + K, K, 2 * K, K, 2 * K, K]


def test_lr_schedule_advances_once_per_commit():
  params = as_f32(init_params())
  schedule = lambda count: 0.1 * (count + 1)
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
  mesh = jax.make_mesh((N,), ("data",))
  train = acco_jax.make_train_step(
    loss_fn, acco_jax.acco(inner, comm_dtype=jnp.float32), mesh, num_microbatches=K, params=params
  )
  state = train.init(params, first_microbatch())
  lrs = []
  for batch in make_batches(6):
    state, _ = train.step(state, batch)
    lrs.append(float(acco_jax.hyperparams(state.opt_state)["learning_rate"]))
  # the LR stored is the one of the last commit: stage 1 -> count 0, stage 3 -> count 1, ...
  np.testing.assert_allclose(lrs, [0.1, 0.1, 0.1, 0.2, 0.2, 0.3], rtol=1e-6)


def test_unequal_counts_give_plain_mean():
  params = as_f32(init_params())
  batch = make_batches(1, k=4)[0]
  counts = [1, 4, 2, 3, 4, 1, 1, 2]
  mesh = jax.make_mesh((N,), ("data",))
  train = acco_jax.make_train_step(
    loss_fn,
    acco_jax.zero1(optax.sgd(1.0), comm_dtype=jnp.float32),
    mesh,
    num_microbatches=4,
    params=params,
  )
  state = train.init(params)
  state, metrics = train.step(state, batch, counts)
  used = [mb for i in range(N) for mb in device_microbatches(batch, i, 4)[: counts[i]]]
  mean_grad = jax.tree.map(lambda *g: sum(g) / len(used), *[grad(params, mb) for mb in used])
  expected = jax.tree.map(lambda p, g: p - g, params, mean_grad)
  assert_trees_close(train.params(state), expected)
  assert float(metrics["microbatches"]) == sum(counts)
  np.testing.assert_allclose(
    float(metrics["loss"]), np.mean([float(loss_fn(params, mb)) for mb in used]), rtol=1e-5
  )


def test_bf16_communication_is_close_to_fp32():
  params = as_f32(init_params())
  batches = make_batches(6)
  inner = optax.sgd(0.1)
  t32, s32 = run_library(acco_jax.acco(inner, comm_dtype=jnp.float32), params, batches, [FULL] * 6)
  t16, s16 = run_library(acco_jax.acco(inner), params, batches, [FULL] * 6)
  assert_trees_close(t16.params(s16), t32.params(s32), rtol=2e-2, atol=2e-2)
  assert t16.compute_params(s16)["scale"].dtype == jnp.bfloat16
