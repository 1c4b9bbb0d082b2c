"""The pipeline at model scale (acco_jax.pipeline.packing, .train): each stage's parameters packed
once (the embedding and head on stage 0 only), stages of different sizes, and the data lanes of each
stage running ddp, zero1 or acco.

References are written here from the single-device model (``layers.loss_fn_ordered``) and the
update rules by hand (SGD with momentum and decoupled weight decay, whose every term moves the
result in a few steps, unlike Adam's normalisation which would amplify summation-order noise);
the pipeline is another program, so float32 tolerances, not bits. Packing moves numbers and is
checked bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from acco_jax import errors, layers, model
from acco_jax.analysis import dataflow
from acco_jax.pipeline import packing, ticks
from acco_jax.pipeline import programs as pipe
from acco_jax.pipeline import step as pipe_train

CFG = model.get_config("tiny", N=4, dtype="float32")
LR, MOMENTUM, WD, CLIP = 0.1, 0.9, 0.1, 2.0
RTOL = 2e-4  # of the largest parameter change: float32 sums in other orders, a few steps


@pytest.fixture(scope="module")
def params():
  return jax.tree.map(np.asarray, model.init_params(CFG, 0))


def _batches(n, rows, seed=0):
  rng = np.random.default_rng(seed)
  tok = rng.integers(0, CFG.V, size=(n, rows, 17), dtype=np.int32)
  return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tok]


def _order(counts, path):
  starts = np.cumsum((0, *counts[:-1]))
  return np.array(
    [b for s in (0, *path) for b in range(starts[s], starts[s] + counts[s])], np.int32
  )


@jax.jit
def _grad(params, batch, order):
  return jax.value_and_grad(lambda p: layers.loss_fn_ordered(p, CFG, batch, order)[0])(params)


def _mean_grad(params, batch, M, lanes, order):
  """The pipeline's per-flush gradient written out: the mean over microbatches and lanes (rows
  [m * lanes * B + l * B, ...)) of each one's single-device gradient."""
  rows = batch["inputs"].shape[0] // (M * lanes)
  total, n = None, 0
  for i in range(M * lanes):
    b = {k: v[i * rows : (i + 1) * rows] for k, v in batch.items()}
    out = _grad(params, b, order)[1]
    total = out if total is None else jax.tree.map(np.add, total, out)
    n += 1
  return jax.tree.map(lambda v: np.asarray(v, np.float64) / n, total)


# ------------------------------------------------------------------------------- packing, splits


def test_packing_holds_every_parameter_once_and_moves_bits(params):
  counts = (1, 2, 1)
  pk = packing.StagePacking(params, counts, multiple=2)
  packed = pk.pack(params)
  assert set(packed) == {"decay", "nodecay"} and all(v.shape[1] % 2 == 0 for v in packed.values())
  back = pk.unpack(packed)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  assert all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True)
  )
  # every stage holds its own blocks and stage 0 alone the embedding: the buffers' real contents
  # add up to the model, and a device holds less than the replicated embedding plus 2 blocks
  per_block = sum(x.size for x in jax.tree.leaves(params["blocks"]["0"]))
  shared = model.num_params(params) - CFG.N * per_block
  assert sum(pk.sizes.values()) < shared + 2 * per_block
  ones = pk.pack(jax.tree.map(lambda x: np.ones_like(x), params))  # padding stays zero
  real = sum(v.sum(axis=1) for v in ones.values())
  assert list(real) == [counts[0] * per_block + shared, *(c * per_block for c in counts[1:])]
  # the traced views read the blocks and the shared leaves at their places
  local = {g: jnp.asarray(v[1]) for g, v in packed.items()}
  np.testing.assert_array_equal(
    pk.blocks(local)["attn_qkv"]["kernel"][1], params["blocks"]["2"]["attn_qkv"]["kernel"]
  )
  local0 = {g: jnp.asarray(v[0]) for g, v in packed.items()}
  np.testing.assert_array_equal(pk.shared(local0)["wte"]["embedding"], params["wte"]["embedding"])


def test_balanced_split_gives_stage_0_fewer_blocks():
  gpt2 = model.get_config("gpt2")
  assert packing.head_cost(gpt2) > 4  # the tied head costs more than four blocks
  counts8 = packing.balanced_counts(gpt2, 8)
  assert sum(counts8) == 12 and min(counts8) == 1 and counts8[0] == 1 and max(counts8) == 2
  assert packing.balanced_counts(gpt2, 4) == (1, 4, 4, 3)
  assert packing.balanced_counts_for(12, 4, 0.0) == (3, 3, 3, 3)
  assert packing.parse_counts("2,1,1", 4, 3) == (2, 1, 1)
  for bad in ("2,2", "0,2,2", "1,1,1", "a,b,c"):
    with pytest.raises(errors.UserValueError, match=r"blocks_per_stage=.* must list 3 block"):
      packing.parse_counts(bad, 4, 3)


@pytest.mark.slow  # ~20 s (the default run's single-device check: pipeline_test, equal stages)
@pytest.mark.parametrize("counts,paths", [((1, 2, 1), [(1, 2), (2,), (2, 1), ()])])
def test_uneven_stages_equal_the_single_device_model(params, counts, paths):
  S = len(counts)
  sched = ticks.build(paths, S, "gpipe")
  mesh = pipe.make_mesh(S, 1, jax.devices()[:S])
  pk = pipe.packing_for(params, S, counts)
  batch = {k: np.stack([b[k] for b in _batches(len(paths), 2)]) for k in ("inputs", "targets")}
  fn = jax.jit(pipe.make_loss_and_grad(CFG, mesh, sched, pk))
  loss, grads = fn(pipe.place_params(pk.pack(params), mesh), pipe.place_batch(batch, mesh))
  ref_loss, ref = None, None
  for m, path in enumerate(paths):
    out = _grad(params, {k: v[m] for k, v in batch.items()}, _order(counts, path))
    ref_loss = out[0] if ref_loss is None else ref_loss + out[0]
    ref = out[1] if ref is None else jax.tree.map(np.add, ref, out[1])
  np.testing.assert_allclose(loss, ref_loss / len(paths), rtol=1e-5)
  got = pk.unpack(jax.device_get(grads))
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref), strict=True
  ):
    np.testing.assert_allclose(
      a, np.asarray(b) / len(paths), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
    )


# ----------------------------------------------------------------------------- the lanes' methods

S, LANES, M, B = 2, 2, 2, 2
COUNTS = (1, 3)


def _tx(decay_mask):
  return optax.chain(
    optax.clip_by_global_norm(CLIP),
    optax.add_decayed_weights(WD, decay_mask),
    optax.sgd(LR, momentum=MOMENTUM),
  )


def _train(params, data_method):
  mesh = pipe.make_mesh(S, LANES, jax.devices()[: S * LANES])
  sched = ticks.build([(1,)] * M, S, "gpipe")
  pk = pipe.packing_for(params, S, COUNTS, LANES)
  return pipe_train.PipelineStep(
    CFG, _tx(pk.decay_mask()), mesh, sched, params, None, COUNTS, data_method, jnp.float32
  )


def _run(params, data_method, batches):
  train = _train(params, data_method)
  state = train.init(params)
  metrics = []
  for b in batches:
    state, m = train.step(state, b)
    metrics.append(jax.device_get(m))
  return train, state, metrics


def _close(got, ref, start):
  """Parameter trees equal to RTOL of the largest change from ``start``."""
  scale = max(
    float(np.max(np.abs(np.asarray(r) - s)))
    for r, s in zip(jax.tree.leaves(ref), jax.tree.leaves(start), strict=True)
  )
  assert scale > 1e-3  # the steps moved the parameters
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref), strict=True
  ):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=0, atol=RTOL * scale, err_msg=jax.tree_util.keystr(path)
    )


@pytest.mark.slow  # ~23 s: two pipeline programs (ACCO over the lanes: its reference, below)
def test_zero1_over_the_lanes_equals_ddp(params):
  batches = _batches(3, M * LANES * B, seed=1)
  ddp, s_ddp, m_ddp = _run(params, "ddp", batches)
  zero1, s_zero1, m_zero1 = _run(params, "zero1", batches)
  # the optimizer state is sharded over the lanes (and the stages), the weights whole per stage
  momentum = jax.tree.leaves(s_zero1.opt_state)[-1]
  assert tuple(momentum.sharding.spec) == ("stage", "data") and momentum.shape[0] == S
  assert tuple(jax.tree.leaves(s_ddp.opt_state)[-1].sharding.spec) == ("stage",)
  # the clip acts on some steps (the global norm over every lane's shard decides the scale), not
  # on others (a wrong scale of the reduced gradient would show)
  assert {bool(m["grad_norm"] > CLIP) for m in m_ddp} == {True, False}
  np.testing.assert_allclose([m["loss"] for m in m_zero1], [m["loss"] for m in m_ddp], rtol=1e-5)
  _close(zero1.params(s_zero1), ddp.params(s_ddp), params)


def _sgd_step(theta, g, trace, decay):
  """One step of _tx written out: clip by the global norm, decoupled decay, momentum SGD."""
  norm = np.sqrt(sum(float(np.sum(np.square(x))) for x in jax.tree.leaves(g)))
  g = jax.tree.map(lambda x: x * min(1.0, CLIP / norm), g)
  g = jax.tree.map(lambda x, p, d: x + WD * p if d else x, g, theta, decay)
  trace = jax.tree.map(lambda t, x: MOMENTUM * t + x, trace, g)
  return jax.tree.map(lambda p, t: p - LR * t, theta, trace), trace


def test_acco_over_the_lanes_equals_its_reference(params):
  """Flush 1 fills the buffer at θ0; then estimates and commits alternate:
  θ̃ = Opt(θ, g̃ / ñ; S) (state dropped), (θ', S') = Opt(θ, (g̃ + g) / (ñ + n); S), each flush
  computing at the weights the previous one produced, and its gradients reduced during the next."""
  batches = _batches(5, M * LANES * B, seed=2)
  train, state, metrics = _run(params, "acco", batches)
  order = np.arange(CFG.N, dtype=np.int32)
  decay = model.decay_mask(params)
  theta = jax.tree.map(lambda x: x.astype(np.float64), params)
  trace = jax.tree.map(np.zeros_like, theta)
  grad = lambda w, b: _mean_grad(jax.tree.map(np.float32, w), b, M, LANES, order)
  g_fill = grad(theta, batches[0])  # flush 1: at θ0
  g_est = grad(theta, batches[1])  # flush 2 (estimate) computes at θ0 too
  estimate, _ = _sgd_step(theta, g_fill, trace, decay)
  theta, trace = _sgd_step(
    theta, jax.tree.map(lambda a, b: (a + b) / 2, g_fill, g_est), trace, decay
  )
  g_tilde = grad(estimate, batches[2])  # flush 3 (commit 1) computes at θ̃1
  g_at = grad(theta, batches[3])  # flush 4 (estimate 2) at θ1
  estimate, _ = _sgd_step(theta, g_tilde, trace, decay)  # applied by flush 4
  theta, trace = _sgd_step(
    theta, jax.tree.map(lambda a, b: (a + b) / 2, g_tilde, g_at), trace, decay
  )  # flush 5, commit 2
  assert [bool(m["committed"]) for m in metrics] == [False, False, True, False, True]
  _close(train.params(state), theta, params)
  # the weights flush 6 would compute at are the committed ones (after a commit)
  w = train.packing.unpack(jax.device_get(state.w))
  _close(w, theta, params)
  # the estimate moved the result: flush 4's loss is at θ1, not at θ̃1 or θ0
  assert metrics[2]["loss"] != metrics[3]["loss"]


def test_acco_reduction_and_gather_do_not_touch_the_flush(params):
  """In ACCO's step the reduce-scatter (of the previous flushes) and the all-gather (of the new
  weights) over ``data`` neither read the flush's loop nor feed it; ZeRO-1's reduce-scatter reads it
  (the control)."""
  batch = _batches(1, M * LANES * B)[0]

  def report(method):
    train = _train(params, method)
    state = train.abstract_state(params)
    jaxpr = jax.make_jaxpr(train.stage_fn)(state, batch)
    return dataflow.dataflow_report(jaxpr, psum_limit=16, axis="data")

  acco = report("acco")
  kinds = {c.kind for c in acco.collectives}
  assert "reduce_scatter" in kinds and "all_gather_invariant" in kinds, kinds
  assert acco.loops >= 1 and not acco.loop_feeds_comm and not acco.comm_feeds_loop
  assert report("zero1").loop_feeds_comm


def test_checkpoint_with_another_split_is_refused(params):
  train = _train(params, "ddp")
  assert train.checkpoint_extra() == {"blocks_per_stage": [1, 3]}
  with pytest.raises(errors.UserValueError, match=r"blocks_per_stage=2,2"):
    train.check_checkpoint({"blocks_per_stage": [2, 2]})


@pytest.mark.slow  # ~28 s each: a train.py launch (the default run's: pipeline_train_test)
@pytest.mark.parametrize("opt", ["adamw", "muon"])
def test_train_py_runs_acco_over_the_lanes_of_a_pipeline(tmp_path, capsys, opt):
  """One launch: configs/gpt2_pipeline.py:tiny with pipeline.data_method=acco on 2 lanes x 4 stages,
  with AdamW and with Muon (the lanes own whole matrices: pipeline_muon_test.py; bit-exact resume
  after SIGKILLs, uneven stages: crash_resume_test.py, slow)."""
  import json
  import pathlib

  from acco_jax.run import trainer
  from configs import gpt2_pipeline

  config = gpt2_pipeline.get_config("tiny")
  config.pipeline.data_method, config.opt.name = "acco", opt
  config.data.cache_dir = str(pathlib.Path(__file__).parent / ".." / ".pytest_cache" / "acco_data")
  config.ckpt.async_save = False
  config.train.num_updates, config.train.log_every = 2, 1
  config.train.eval_every, config.train.eval_batches, config.train.sample_tokens = 0, 1, 0
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  assert summary["stages"] == 5 and summary["updates"] == 2, summary
  assert "pipeline: 4 stages x 2 lanes (acco), blocks per stage 1,1,1,1" in capsys.readouterr().out
  rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  losses = {r["stage"]: r["loss"] for r in rows if "loss" in r}
  assert sorted(losses) == [1, 2, 3, 4, 5] and losses[5] < losses[1], losses
