"""Structure of the compiled step: dataflow, collectives, sharding and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acco_jax
from acco_jax.analysis import dataflow, hlo
from tests.methods_test import B, K, N, as_f32, first_microbatch, init_params, loss_fn, make_batches

METHOD_NAMES = ("acco", "zero1", "ddp", "dpu", "wp")


def build(name, inner=None, comm_dtype=jnp.float32, k=K):
  params = as_f32(init_params())
  inner = inner or optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  tx = acco_jax.get_method(name, inner, comm_dtype=comm_dtype)
  mesh = jax.make_mesh((N,), ("data",))
  train = acco_jax.make_train_step(loss_fn, tx, mesh, num_microbatches=k, params=params)
  state = train.init(params, first_microbatch())
  return train, state


def stage_program(train, state):
  kind = "delayed" if train.plan.delayed else "sync"
  fn = train.stage_program(kind, state)
  batch = train.put_batch(make_batches(1)[0], K)
  return fn, (state, batch)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_jaxpr_dataflow(name):
  train, state = build(name)
  fn, args = stage_program(train, state)
  report = dataflow.dataflow_report(jax.make_jaxpr(fn)(*args), psum_limit=16)
  # delayed methods split the microbatches into two loops, one for each collective to hide behind
  assert report.loops == (2 if train.plan.delayed else 1)
  assert report.collectives_in_loop == ()
  if name == "ddp":  # the gradient all-reduce of DDP is the one large psum, after the loop
    assert len(report.large_psums) == 1 and report.loop_feeds_comm
  else:
    assert report.large_psums == (), "a gradient all-reduce crept into a ZeRO-1 step"
  # delayed methods: communication and loop independent both ways; sync methods: comm after loop
  assert report.overlappable == train.plan.delayed
  assert report.loop_feeds_comm == (not train.plan.delayed)


def test_dataflow_check_catches_gradient_psum():
  """The check can fail: differentiating invariant weights inside shard_map psums the gradients."""
  mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  P = jax.P

  def local(w, x):
    def body(i, acc):
      return acc + jax.grad(lambda w: jnp.sum((x[i] * w) ** 2))(w)

    return jax.lax.fori_loop(
      0, x.shape[0], body, jnp.zeros_like(w) + jax.lax.pcast(0.0, "data", to="varying")
    )

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))
  report = dataflow.dataflow_report(
    jax.make_jaxpr(fn)(jnp.ones(64), jnp.ones((N * 2, 64))), psum_limit=16
  )
  assert report.collectives_in_loop, "implicit psum inside the loop should be detected"


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_compiled_collectives(name):
  train, state = build(name)
  fn, args = stage_program(train, state)
  found = hlo.hlo_collectives(fn.lower(*args).compile().as_text())
  flat_bytes = train.layout.padded_size * 4  # fp32 comm
  big = [c for c in found if c.bytes >= flat_bytes]
  small = [c for c in found if c.bytes < 256]
  assert len(big) + len(small) == len(found), f"unexpected mid-size collectives: {found}"
  assert not any(c.in_loop for c in found)
  kinds = sorted(c.kind for c in big)
  if name == "ddp":
    assert kinds == ["all-reduce"]
  else:
    assert kinds == ["all-gather", "reduce-scatter"]
    assert all(c.bytes == flat_bytes for c in big)


def test_bf16_comm_halves_bytes():
  train, state = build("acco", comm_dtype=jnp.bfloat16)
  fn, args = stage_program(train, state)
  report = dataflow.dataflow_report(jax.make_jaxpr(fn)(*args))
  movers = sorted((c.kind, c.bytes) for c in report.collectives if c.kind in dataflow.DATA_MOVERS)
  S = train.layout.shard_size
  assert movers == [("all_gather_invariant", 2 * S), ("reduce_scatter", 2 * N * S)]
  # The compiled CPU module moves f32 for both (XLA:CPU normalizes bf16 collectives to f32);
  # docs/benchmarks/dp.md, "Communication accounting", records this; the GPU check reads the dtype
  # from GPU HLO instead.


@pytest.mark.parametrize("name", ["acco", "zero1", "ddp"])
def test_state_is_sharded(name):
  train, state = build(name)
  state, _ = train.step(state, make_batches(1)[0])
  spec = train.layout.specs[0]
  leaves = jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state)
  for x in leaves:
    if x.ndim < 2:
      continue
    shard_rows = {s.data.shape[0] for s in x.addressable_shards}
    expected = 1 if train.plan.sharded else N
    assert shard_rows == {expected}, (x.shape, shard_rows)
  n_master_bytes = sum(
    s.data.nbytes for s in state.params[spec and "hidden"]["kernel"].addressable_shards[:1]
  )
  assert n_master_bytes == (
    4 * train.layout.specs[1].chunk if train.plan.sharded else 4 * N * train.layout.specs[1].chunk
  )


def test_state_sharding_types_are_stable():
  train, state = build("acco")
  before = jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), state)
  state, _ = train.step(state, make_batches(1)[0])
  after = jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), state)
  assert before == after


def test_batch_not_divisible_is_a_clear_error():
  train, state = build("acco")
  bad = jax.tree.map(lambda x: x[:-1], make_batches(1)[0])
  with pytest.raises(ValueError, match="not divisible by devices x microbatches"):
    train.step(state, bad)


def test_unknown_axis_name_is_a_clear_error():
  params = as_f32(init_params())
  mesh = jax.make_mesh((N,), ("data",))
  with pytest.raises(ValueError, match="axis_name 'batch' is not an axis of the mesh"):
    acco_jax.make_train_step(
      loss_fn,
      acco_jax.acco(optax.sgd(0.1), axis_name="batch"),
      mesh,
      num_microbatches=1,
      params=params,
    )


@pytest.mark.parametrize(
  "inner",
  [optax.adafactor(1e-3, min_dim_size_to_factor=4), optax.contrib.muon(1e-3)],
  ids=["adafactor", "muon"],
)
@pytest.mark.parametrize("method", [acco_jax.acco, acco_jax.zero1])
def test_non_elementwise_inner_takes_the_owner_layout(method, inner):
  """layout='auto' (the default) gives an optimizer that is not elementwise whole matrices; the
  elementwise layout, asked for, refuses it in one line."""
  params = {"w": jnp.ones((16, 24)), "b": jnp.ones(24)}
  mesh = jax.make_mesh((N,), ("data",))
  train = acco_jax.make_train_step(loss_fn, method(inner), mesh, num_microbatches=1, params=params)
  assert train.plan.layout == "owner" and train.owner
  with pytest.raises(ValueError, match="shaped differently.*comm.layout=owner") as info:
    acco_jax.make_train_step(
      loss_fn, method(inner, layout="elementwise"), mesh, num_microbatches=1, params=params
    )
  assert "\n" not in str(info.value)
  # DDP keeps the whole state on each device, so any optimizer works there
  acco_jax.make_train_step(loss_fn, acco_jax.ddp(inner), mesh, num_microbatches=1, params=params)


def test_plain_optax_transform_is_rejected():
  params = as_f32(init_params())
  mesh = jax.make_mesh((N,), ("data",))
  with pytest.raises(TypeError, match="wrap your optax optimizer"):
    acco_jax.make_train_step(loss_fn, optax.adamw(1e-3), mesh, num_microbatches=1, params=params)


def test_missing_first_microbatch_and_bad_counts():
  params = as_f32(init_params())
  mesh = jax.make_mesh((N,), ("data",))
  train = acco_jax.make_train_step(
    loss_fn, acco_jax.acco(optax.sgd(0.1)), mesh, num_microbatches=K, params=params
  )
  with pytest.raises(ValueError, match="one microbatch per device"):
    train.init(params)
  state = train.init(params, first_microbatch())
  with pytest.raises(ValueError, match=r"counts must be 8 ints in \[1, 2\]"):
    train.step(state, make_batches(1)[0], counts=[3] * N)
  with pytest.raises(ValueError, match="unknown method 'adam'"):
    acco_jax.get_method("adam", optax.sgd(0.1))


def test_aux_metrics_are_summed():
  params = as_f32(init_params())
  mesh = jax.make_mesh((N,), ("data",))

  def loss_with_aux(p, mb):
    return loss_fn(p, mb), {"rows": jnp.float32(mb["x"].shape[0])}

  train = acco_jax.make_train_step(
    loss_with_aux,
    acco_jax.acco(optax.sgd(0.1)),
    mesh,
    num_microbatches=K,
    params=params,
    has_aux=True,
  )
  state = train.init(params, first_microbatch())
  _, metrics = train.step(state, make_batches(1)[0], counts=[1, 2, 1, 2, 1, 2, 1, 2])
  assert float(metrics["rows"]) == 12 * B
  assert float(metrics["microbatches"]) == 12
  assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0


def test_nonfinite_microbatches_are_skipped():
  """skip_nonfinite: a NaN microbatch drops out of the mean; buffers and ACCO state stay finite."""
  from tests.methods_test import assert_trees_close, device_microbatches, grad

  params = as_f32(init_params())
  mesh = jax.make_mesh((N,), ("data",))
  batch = make_batches(1, k=2)[0]
  bad_rows = [0, 2 * B * 3 + B]  # device 0 microbatch 0, device 3 microbatch 1
  for r in bad_rows:
    batch["x"][r, 0] = np.nan
  tx = acco_jax.zero1(optax.sgd(1.0), comm_dtype=jnp.float32)
  train = acco_jax.make_train_step(
    loss_fn, tx, mesh, num_microbatches=2, params=params, skip_nonfinite=True
  )
  state, metrics = train.step(train.init(params), batch)
  good = [
    mb for i in range(N) for mb in device_microbatches(batch, i, 2) if np.isfinite(mb["x"]).all()
  ]
  assert len(good) == 2 * N - 2 and float(metrics["skipped"]) == 2
  mean = jax.tree.map(lambda *g: sum(g) / len(good), *[grad(params, mb) for mb in good])
  assert_trees_close(train.params(state), jax.tree.map(lambda p, g: p - g, params, mean))

  # ACCO: the buffer keeps only finite sums, so training continues finitely
  acco_step = acco_jax.make_train_step(
    loss_fn,
    acco_jax.acco(optax.adam(1e-2)),
    mesh,
    num_microbatches=2,
    params=params,
    skip_nonfinite=True,
  )
  state = acco_step.init(params, first_microbatch())
  for _ in range(4):
    state, metrics = acco_step.step(state, batch)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
  assert float(metrics["skipped"]) == 2

  # every microbatch bad: weights and optimizer state do not move
  all_bad = jax.tree.map(lambda x: np.full_like(x, np.nan), batch)
  state0 = train.init(params)
  before = jax.device_get(state0.params)
  state1, metrics = train.step(state0, all_bad)
  assert float(metrics["microbatches"]) == 0
  for x, y in zip(
    jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state1.params)), strict=True
  ):
    np.testing.assert_array_equal(x, y)  # exact: a skipped update leaves the weights untouched
