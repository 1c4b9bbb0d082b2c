"""Quantized communication in the 8-device step, against references written here in NumPy.

The references follow the issue's rules, not the library's code: a device's gradient buffer (the
flat shard-major row, laid out here from the parameter shapes) is summed within its node, each
destination's chunk is quantized by ``tests.quantize_test.ref_quantize``, the receivers sum what
they get; what a send did not deliver stays in the sender's accumulator at a commit (ACCO) or for
the next stage (ZeRO-1); the compute weights receive the quantized difference between the new
weights and the weights every device holds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acco_jax
from acco_jax.analysis import dataflow, hlo
from acco_jax.ckpt import checkpoint
from acco_jax.dp import quantize as Q
from acco_jax.dp.plan import comm_bytes_per_stage
from tests import methods_test as methods_ref
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
  local_sums,
  loss_fn,
  make_batches,
  opt_step,
)
from tests.quantize_test import ref_quantize

PARAMS = as_f32(init_params())
BLOCK = 4  # a shard here is S = 11 values: two full blocks and one padded


def rows_of(tree, n=N):
  """A tree -> the shard-major rows ``[n, S]``: row i = chunk i of every leaf (zero padded)."""
  out = []
  for x in jax.tree.leaves(tree):
    x = np.ravel(np.asarray(x, np.float32))
    c = -(-x.size // n)
    out.append(np.pad(x, (0, c * n - x.size)).reshape(n, c))
  return np.concatenate(out, axis=1)


def tree_of(rows, n=N):
  """Rows ``[n, S]`` (or flat) -> a tree shaped like the parameters."""
  rows = np.asarray(rows, np.float32).reshape(n, -1)
  leaves, start = [], 0
  for p in jax.tree.leaves(PARAMS):
    c = -(-p.size // n)
    leaves.append(jnp.asarray(rows[:, start : start + c].reshape(-1)[: p.size].reshape(p.shape)))
    start += c
  return jax.tree.unflatten(jax.tree.structure(PARAMS), leaves)


def sent(x, mode):
  return ref_quantize(np.asarray(x, np.float32)[None], mode, BLOCK)[2][0]


def ref_exchange(bufs, mode, node_size):
  """Per-device flat buffers -> (summed rows ``[N, S]``, per-device flat residuals)."""
  X = np.stack([b.reshape(N, -1) for b in bufs])  # [device, chunk, S]
  total, rest = np.zeros_like(X[0]), np.zeros_like(X)
  for dev in range(N):
    node, rank = divmod(dev, node_size)
    members = range(node * node_size, (node + 1) * node_size)
    for other in range(N // node_size):
      chunk = other * node_size + rank
      node_sum = sum(X[m, chunk] for m in members)
      out = sent(node_sum, mode)
      total[chunk] += out
      rest[dev, chunk] = node_sum - out
  return total, [r.reshape(-1) for r in rest]


def ref_weights(w, target, mode):
  """Every device adds the quantized ``target - w`` of each shard to ``w`` (flat, float32)."""
  w_rows = w.reshape(N, -1)
  t_rows = target if isinstance(target, np.ndarray) else rows_of(target)
  return (w_rows + np.stack([sent(t_rows[j] - w_rows[j], mode) for j in range(N)])).reshape(-1)


def ref_acco(inner, batches, mode, node_size):
  theta, S = PARAMS, inner.init(PARAMS)
  bufs = [
    rows_of(grad(PARAMS, device_microbatches(first_microbatch(), i, 1)[0])).reshape(-1)
    for i in range(N)
  ]
  counts, w = [1] * N, rows_of(PARAMS).reshape(-1)
  for c, batch in enumerate(batches):
    total, rest = ref_exchange(bufs, mode, node_size)
    target, S_new = opt_step(inner, tree_of(total / sum(counts)), S, theta)
    new = [rows_of(s).reshape(-1) for s in local_sums(tree_of(w), batch, FULL)]
    if c % 2 == 0:  # estimate: the accumulator keeps the whole buffer (nothing was committed)
      bufs, counts = [b + s for b, s in zip(bufs, new, strict=True)], [n + K for n in counts]
    else:  # commit: it keeps what the send did not deliver
      theta, S = target, S_new
      bufs, counts = [r + s for r, s in zip(rest, new, strict=True)], [K] * N
    w = ref_weights(w, target, mode)
  return theta, w


def ref_zero1(inner, batches, mode, node_size):
  theta, S = PARAMS, inner.init(PARAMS)
  w, rest = rows_of(PARAMS).reshape(-1), [np.zeros(N * 11, np.float32)] * N
  for batch in batches:
    new = [rows_of(s).reshape(-1) for s in local_sums(tree_of(w), batch, FULL)]
    total, rest = ref_exchange([r + s for r, s in zip(rest, new, strict=True)], mode, node_size)
    theta, S = opt_step(inner, tree_of(total / (N * K)), S, theta)
    w = ref_weights(w, theta, mode)
  return theta, w


def leaves_of(*trees):
  return zip(*(map(np.asarray, jax.tree.leaves(t)) for t in trees), strict=True)


def build(name, mode="int8", node_size=1, inner=None, comm_dtype=jnp.float32, mesh_devices=N, **kw):
  inner = inner or inner_optimizer(PARAMS)
  tx = acco_jax.get_method(
    name, inner, comm_dtype=comm_dtype, quantize=mode, block=BLOCK, node_size=node_size, **kw
  )
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:mesh_devices]), ("data",))
  k = N * K // mesh_devices  # the same rows per stage on any device count
  train = acco_jax.make_train_step(loss_fn, tx, mesh, num_microbatches=k, params=PARAMS)
  if mesh_devices != N:
    return train, None
  return train, train.init(PARAMS, first_microbatch())


def run(train, state, batches):
  for batch in batches:
    state, _ = train.step(state, batch)
  return state


@pytest.mark.parametrize(
  "name,mode,node_size", [("acco", "int8", 1), ("acco", "int4", 2), ("zero1", "int4", 1)]
)
def test_matches_the_reference(name, mode, node_size):
  """10 stages, AdamW with clipping and a decay mask, shards of S = 11 in blocks of 4 (padded)."""
  stages = 10
  batches = make_batches(stages)
  inner = inner_optimizer(PARAMS)
  train, state = build(name, mode, node_size)
  state = run(train, state, batches)
  theta, w = {"acco": ref_acco, "zero1": ref_zero1}[name](inner, batches, mode, node_size)
  tol = dict(rtol=1e-5, atol=5e-5)  # a float32 tie in a node sum may round the other way
  assert_trees_close(train.params(state), theta, **tol)
  np.testing.assert_allclose(np.asarray(state.w), w, **tol)
  # the comparison can fail: quantization moves the weights well beyond that tolerance
  full = [FULL] * stages
  plain = {
    "acco": methods_ref.ref_acco(inner, PARAMS, first_microbatch(), batches, full)[0],
    "zero1": methods_ref.ref_sync(inner, PARAMS, batches, full),
  }[name]
  moved = max(np.abs(a - b).max() for a, b in leaves_of(theta, plain))
  assert moved > 3e-4, moved  # five times the tolerance


# -- error feedback: nothing is lost -----------------------------------------------------------

R = np.random.default_rng(7)
DIRECTIONS = [
  jax.tree.map(lambda p: R.normal(size=p.shape).astype(np.float32), PARAMS) for _ in range(2)
]


def linear_loss(p, mb):
  """Gradient ``mean(x) D0 + mean(y) D1``: known exactly, whatever the weights."""
  a, b = jnp.mean(mb["x"]), jnp.mean(mb["y"])
  terms = jax.tree.map(lambda w, d0, d1: jnp.sum(w * (a * d0 + b * d1)), p, *DIRECTIONS)
  return sum(jax.tree.leaves(terms))


def linear_grad(mbs):
  """Σ of the gradients of ``mbs`` as float64 rows ``[N, S]``."""
  a = sum(np.mean(mb["x"], dtype=np.float64) for mb in mbs)
  b = sum(np.mean(mb["y"], dtype=np.float64) for mb in mbs)
  return a * rows_of(DIRECTIONS[0]).astype(np.float64) + b * rows_of(DIRECTIONS[1])


def stage_mbs(batch):
  return [mb for i in range(N) for mb in device_microbatches(batch, i)]


@pytest.mark.parametrize("name", ["zero1", "acco"])
def test_sent_plus_residual_equals_the_gradients(name):
  """SGD(1): each update is -(what was sent)/count. Over 12 stages, everything sent plus what the
  devices still hold equals the sum of every gradient; a send's error is not lost, nor counted
  twice (the estimate's send is not committed, so its error must not be fed back)."""
  tx = acco_jax.get_method(
    name, optax.sgd(1.0), comm_dtype=jnp.float32, quantize="int4", block=BLOCK
  )
  mesh = jax.make_mesh((N,), ("data",))
  train = acco_jax.make_train_step(linear_loss, tx, mesh, num_microbatches=K, params=PARAMS)
  state = train.init(PARAMS, first_microbatch())
  batches = make_batches(12, seed=3)
  thetas = [rows_of(PARAMS).astype(np.float64)]
  for batch in batches:
    state, m = train.step(state, batch)
    if bool(m["committed"]):
      thetas.append(rows_of(train.params(state)).astype(np.float64))
  if name == "zero1":
    counts = [N * K] * 12
    held = np.asarray(state.residual, np.float64).sum(0).reshape(N, -1)
    gradients = linear_grad([mb for b in batches for mb in stage_mbs(b)])
  else:  # commit c ships the buffer of the two stages before it (the first: + the primer)
    counts = [N * (1 + K)] + [N * 2 * K] * 5
    held = np.asarray(state.buf, np.float64).sum(0).reshape(N, -1)  # residual + last stage
    mbs = [mb for b in batches for mb in stage_mbs(b)]
    gradients = linear_grad(mbs + device_microbatches(first_microbatch(), 0, N))
  sent = sum(n * (a - b) for n, a, b in zip(counts, thetas[:-1], thetas[1:], strict=True))
  missing = np.abs(sent + held - gradients).max()
  assert missing < 1e-6 * np.abs(gradients).max(), (missing, np.abs(gradients).max())
  assert np.abs(held - (0 if name == "zero1" else linear_grad(stage_mbs(batches[-1])))).max() > 1e-3


# -- the compute weights track the master weights ------------------------------------------------


def to_bf16(x):
  return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def bf16_ulp(x):
  return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 2.0**-126))) - 7)


def test_compute_weights_follow_every_estimate_and_commit(mode="int4"):
  """bf16 weights, AdamW, 30 stages. At every stage (estimate: θ̃, never committed; commit: θ) the
  new w is exactly bf16(w + Q(target - w)) computed here, so |w - bf16(target)| is at most half a
  quantization step of that update plus one bf16 step, at every stage: the error of one send is
  part of the next send, never added up. Sending Q(target - previous target) instead (no
  feedback) drifts away."""
  worst = {}
  for feedback in (True, False):
    train, state = build(
      "acco", mode, inner=optax.adamw(1e-2), comm_dtype=jnp.bfloat16, error_feedback=feedback
    )
    worst[feedback] = []
    for batch in make_batches(30, seed=11):
      w_before = np.asarray(state.w, np.float32)
      state, _ = train.step(state, batch)
      target = rows_of(state.params)  # θ̃ after an estimate, θ after a commit
      w = np.asarray(state.w, np.float32).reshape(N, -1)
      error = np.abs(w - to_bf16(target))
      worst[feedback].append(error.max())
      if feedback:  # exact: elementwise quantize, add and bf16 rounding, no order-dependent sum
        np.testing.assert_array_equal(w.reshape(-1), to_bf16(ref_weights(w_before, target, mode)))
        _, scale, _ = ref_quantize(target - w_before.reshape(N, -1), mode, BLOCK)
        step = np.repeat(scale, BLOCK, axis=-1)[:, : w.shape[1]]
        assert np.all(error <= step / 2 + bf16_ulp(np.maximum(np.abs(w), np.abs(target))))
  on, off = np.asarray(worst[True]), np.asarray(worst[False])
  assert on[-10:].max() <= 1.5 * on[:10].max(), on  # it does not grow
  assert off[-10:].mean() > 3 * on[-10:].mean(), (off, on)  # without feedback it does


# -- the compiled program: what moves, where ---------------------------------------------------


def stage_program(train, state):
  fn = train.stage_program("delayed" if train.plan.delayed else "sync", state)
  return fn, (state, train.put_batch(make_batches(1)[0], K))


@pytest.mark.parametrize(
  "name,mode,node_size", [("acco", "int8", 1), ("acco", "int4", 2), ("zero1", "int8", 1)]
)
def test_compiled_collectives_move_integers(name, mode, node_size):
  """The stage moves int8 bytes: one all-to-all of every device's encoded chunks (node sums with
  nodes of 2, after a reduce-scatter inside each node) and one all-gather of the encoded weight
  updates, outside the loops, with no gradient all-reduce; the bytes are the trainer's."""
  train, state = build(name, mode, node_size)
  fn, args = stage_program(train, state)
  report = dataflow.dataflow_report(jax.make_jaxpr(fn)(*args), psum_limit=16)
  assert report.loops == (2 if name == "acco" else 1) and not report.large_psums
  assert not report.collectives_in_loop and report.loop_feeds_comm == (name == "zero1")
  # with nodes, the node's reduce-scatter precedes loop A (the node sums are quantized and sent
  # before it; what they did not deliver starts the commit's accumulator)
  assert report.comm_feeds_loop == (name == "acco" and node_size > 1)
  found = [c for c in hlo.hlo_collectives(fn.lower(*args).compile().as_text()) if c.bytes > 64]
  wire = Q.wire_bytes(train.layout.shard_size, mode, BLOCK)  # one encoded shard
  nodes = N // node_size
  want = {("all-to-all", "s8", nodes * wire, nodes), ("all-gather", "s8", N * wire, N)}
  if node_size > 1:  # float32 here (comm_dtype), over the node's devices
    want.add(("reduce-scatter", "f32", 4 * train.layout.padded_size, node_size))
  assert {(c.kind, c.shape[0][0], c.bytes, c.group) for c in found} == want
  assert len(found) == len(want) and not any(c.in_loop for c in found)
  sent = sum((c.group - 1) * c.bytes / c.group for c in found)  # what one device sends
  assert sent == comm_bytes_per_stage(train.plan, train.layout.padded_size, N)


def _eqns(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs in its parameters, with its own jaxpr's eqns."""
  for eqn in jaxpr.eqns:
    yield eqn, jaxpr.eqns
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _eqns(sub)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_acco_all_gather_reads_bytes_encoded_before_loop_b(mode):
  """The all-gather of the encoded weight updates reads the output of loop B's barrier: the bytes
  exist before loop B starts, so XLA:GPU can run the all-gather during it (encoded after the
  barrier, the GPT-2 compile for 8 x H100 ran the encoding and the all-gather after loop B)."""
  train, state = build("acco", mode)
  fn, args = stage_program(train, state)
  found = 0
  for eqn, siblings in _eqns(jax.make_jaxpr(fn)(*args).jaxpr):
    if "all_gather" in eqn.primitive.name and eqn.invars[0].aval.dtype == jnp.int8:
      src = next(e for e in siblings if eqn.invars[0] in e.outvars)
      assert src.primitive.name == "optimization_barrier", src.primitive.name
      found += 1
  assert found == 1


# -- checkpoints: exact resume, and restore on another device count ------------------------------


def test_resume_from_a_checkpoint_is_bit_exact(tmp_path, name="zero1"):
  """ZeRO-1's residual is a state leaf (ACCO's is in its buffer: tests/train_test.py resumes it)."""
  batches = make_batches(4, seed=4)
  train, state = build(name, "int4")
  straight = run(train, state, batches)
  assert straight.residual is not None
  train, state = build(name, "int4")
  with checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(2, run(train, state, batches[:2]), extra={})
    restored, _ = ckpt.restore(None, train.abstract_state(PARAMS))
  resumed = run(train, restored, batches[2:])
  for a, b in leaves_of(straight, resumed):
    np.testing.assert_array_equal(a, b)  # exact: a resume reruns the same programs on the same data


@pytest.mark.parametrize("name", ["zero1", "acco"])
def test_elastic_restore_carries_the_residuals_over(tmp_path, name):
  """8 -> 4 devices: per-device residuals merge pairwise (their sum over devices, what the next
  sends owe, is kept; ACCO's ride in its buffer), w and θ move bit for bit (so does θ - w, the
  weights' residual), and training goes on."""
  train, state = build(name, "int8")
  state = run(train, state, make_batches(3))
  held = "residual" if name == "zero1" else "buf"
  with checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state, extra={})
    small, _ = build(name, "int8", mesh_devices=4)
    restored, _ = ckpt.restore(None, small.abstract_state(PARAMS), reshard=small.reshard)
  before = tree_of(np.asarray(getattr(state, held), np.float64).sum(0))
  after = tree_of(np.asarray(getattr(restored, held), np.float64).sum(0), n=4)
  assert_trees_close(after, before, rtol=1e-6, atol=1e-7)
  assert np.abs(np.asarray(getattr(state, held))).max() > 0
  assert_trees_close(small.compute_params(restored), train.compute_params(state), rtol=0, atol=0)
  for batch in make_batches(2, seed=5):
    restored, m = small.step(restored, batch)
    assert np.isfinite(float(m["loss"]))


def test_settings_this_mesh_cannot_take_are_one_line_errors():
  mesh = jax.make_mesh((N,), ("data",))
  cases = [
    (dict(quantize="int8", block=12), "block=12 is larger than a device's shard of 11 values"),
    (dict(quantize="int8", block=4, node_size=3), "node_size=3 does not divide the 8 devices"),
  ]
  for kwargs, match in cases:
    tx = acco_jax.acco(optax.sgd(0.1), **kwargs)
    with pytest.raises(ValueError, match=match) as info:
      acco_jax.make_train_step(loss_fn, tx, mesh, num_microbatches=K, params=PARAMS)
    assert "\n" not in str(info.value)
  with pytest.raises(TypeError):  # only acco and zero1 take quantization
    acco_jax.dpu(optax.sgd(0.1), quantize="int8")
  # one node of 8: nothing leaves it, so the gradients keep comm_dtype; only the weights quantize
  tx = acco_jax.acco(optax.sgd(0.1), quantize="int8", block=4, node_size=8)
  train = acco_jax.make_train_step(loss_fn, tx, mesh, num_microbatches=K, params=PARAMS)
  assert train.quantized and not train.quantized_reduce
