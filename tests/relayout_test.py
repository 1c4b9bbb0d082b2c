"""ckpt.init_from's first layer: the data-parallel export and import (acco_jax.dp.relayout) on the small
model of methods_test, and the pipeline's both ways. A state trained on 8 devices is saved, read
back as host arrays, exported and imported on 4 devices, and compared bit for bit with a numpy
reading of both states that does not use FlatLayout (elastic_test.logical_shards). The shell and
train.py: ``init_from_test``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax.ckpt import portable
from acco_jax.ckpt.checkpoint import Checkpointer
from acco_jax.dp.methods import AccoState, WpState
from acco_jax.run import build, streams
from configs import gpt2_pipeline, gpt2_zero1
from tests.elastic_test import PARAMS, logical_flat, logical_shards, padding
from tests.elastic_test import build as build_step
from tests.init_from_test import same_bits, tiny, view
from tests.methods_test import B, N, first_microbatch, make_batches

# -- the portable form's helpers -------------------------------------------------------------------


def test_param_subtrees_are_found_in_any_optimizer_state():
  import optax

  params = {"a": np.zeros((2, 3), np.float32), "b": {"c": np.zeros(4, np.float32)}}
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(1e-3))
  state = portable.to_host(tx.init(params))
  found = portable.param_subtrees(state, params)
  assert len(found) == 2  # Adam's mu and nu, not the counts or the injected hyperparameters
  doubled = portable.map_param_subtrees(lambda t: jax.tree.map(lambda x: x + 1, t), state, params)
  assert [float(x.sum()) for x in jax.tree.leaves(portable.param_subtrees(doubled, params))] == [
    6.0,
    4.0,
    6.0,
    4.0,
  ]
  assert int(doubled[1].inner_state[0].count) == 0  # other leaves as they were
  assert doubled[1].hyperparams["learning_rate"] == np.float32(1e-3)
  one = np.zeros(3, np.float32)  # one array: every leaf has its structure, only two its shape
  assert len(portable.param_subtrees(portable.to_host(tx.init(one)), one)) == 2


# -- the data-parallel export and import, method to method and 8 -> 4 devices --------------------


@pytest.fixture(scope="module")
def trained():
  """Per method: the 8-device state after 3 stages (ACCO: after an estimate, mid-round)."""
  out = {}
  for name in ("acco", "zero1", "ddp", "wp"):
    step = build_step(name, N)
    state = step.init(PARAMS, first_microbatch())
    for batch in make_batches(3):
      state, _ = step.step(state, batch)
    out[name] = portable.to_host(state)
  return out


def carried(name, state):
  """θ and Adam's state of a data-parallel state, numpy in the parameters' shapes (no layout)."""
  apart = isinstance(state.opt_state, AccoState | WpState)
  theta = state.opt_state.committed if apart else state.params
  adam = (state.opt_state.inner_state if apart else state.opt_state)[1][0]
  return {
    "theta": logical_shards(theta),
    "mu": logical_shards(adam.mu),
    "nu": logical_shards(adam.nu),
    "count": np.asarray(adam.count),
  }


def through_checkpoint(tmp_path, name, saved, n):
  """``saved`` written by a checkpoint, read back as host arrays by ``name``'s step on ``n``
  devices (as the shell reads another run's checkpoint), and exported."""
  source = build_step(name, n)
  with Checkpointer(tmp_path / name, async_save=False) as ckpt:
    ckpt.save(3, jax.tree.map(jnp.asarray, saved), extra={"stage": 3})
  with Checkpointer(tmp_path / name, read_only=True) as ckpt:
    host, extra = ckpt.restore_host(None, lambda extra: source.abstract_state(PARAMS))
  assert extra == {"stage": 3} and jax.tree.leaves(host)[1].shape[0] == N  # the saved shapes
  return source.export_state(host)


@pytest.mark.parametrize(
  "source,target",
  [("acco", "zero1"), ("zero1", "acco"), ("ddp", "zero1"), ("acco", "ddp"), ("wp", "dpu")],
)
def test_state_carries_over_bit_for_bit(tmp_path, trained, source, target):
  saved = trained[source]
  exported = through_checkpoint(tmp_path, source, saved, 4)
  assert exported.updates == (1 if source == "acco" else 3) and exported.source == source
  if source == "acco":  # after an estimate: θ̃ and two stages of gradients are not carried
    assert "estimate" in exported.dropped and "32 microbatch gradients" in exported.dropped
  if source == "wp":  # the prediction, and the last stage's gradients
    assert exported.dropped == "the predicted weights, 16 microbatch gradients in flight"
  step = build_step(target, 4)
  stage = 2 * exported.updates if target == "acco" else exported.updates
  state = portable.to_host(
    step.import_state(exported, stage, jax.tree.map(lambda x: x[: 4 * B], first_microbatch()))
  )
  want = carried(source, saved)
  same_bits(carried(target, state), want, f"{source} -> {target}")
  same_bits(logical_flat(state.w, 4), want["theta"], "compute weights")  # float32 comm here
  assert not np.any(padding(state.params)) and int(state.stage) == stage
  if step.plan.delayed:  # the buffer primed at θ, one microbatch per device
    same_bits(logical_shards(state.params), want["theta"], "params")
    np.testing.assert_array_equal(state.buf_count, np.ones(4, np.int32))
  if target == "acco":  # a fresh cycle: an estimate next
    assert int(state.opt_state.stage) == stage and stage % 2 == 0


def test_acco_starts_its_cycle_as_a_fresh_run_would(trained):
  """Into ACCO: θ, S and the stage carried; everything else as ``init`` at θ makes it."""
  exported = build_step("zero1", 4).export_state(trained["zero1"])
  step = build_step("acco", 4)
  mb = jax.tree.map(lambda x: x[: 4 * B], first_microbatch())
  imported = portable.to_host(step.import_state(exported, 6, mb))
  fresh = portable.to_host(step.init(exported.params, mb))
  for field in ("w", "params", "buf", "buf_count"):
    same_bits(getattr(imported, field), getattr(fresh, field), field)
  same_bits(imported.opt_state.committed, fresh.opt_state.committed, "committed")
  state = step.import_state(exported, 6, mb)
  state, metrics = step.step(state, make_batches(1, seed=7)[0])  # it trains on
  assert not bool(metrics["committed"]) and np.isfinite(float(metrics["loss"]))
  assert int(state.opt_state.inner_state[1][0].count) == 3  # the estimate does not count


def test_another_optimizer_state_is_refused(trained):
  exported = build_step("zero1", 4).export_state(trained["zero1"])
  wrong = exported._replace(opt=exported.opt[1])  # the clipping state left out
  with pytest.raises(ValueError, match="another tree structure"):
    build_step("zero1", 4).import_state(wrong, 3)


def pipe_run(**overrides):
  """A tiny pipeline run (4 blocks) of ``overrides``, built as train.py builds it."""
  return build.build(tiny(gpt2_pipeline, **{"model.N": 4, **overrides}))


def unpacked(run, host):
  """θ and the inner optimizer state of a pipeline state, in the model's structure."""
  opt, cut = host.opt_state, lambda sub: run.step.packing.unpack(sub)
  apart = isinstance(opt, AccoState)
  inner = opt.inner_state if apart else opt
  return {
    "theta": cut(opt.committed if apart else host.params),
    "opt": portable.map_param_subtrees(cut, inner, host.params),
  }


@pytest.mark.slow  # ~38 s: three step builds and a pipeline stage (the data-parallel moves: test_state_carries_over_bit_for_bit)
def test_pipeline_and_data_parallel_both_ways(tmp_path):
  """A pipeline-ACCO state (2 stages of 1 and 3 blocks x 4 lanes, after 4 flushes: an estimate
  in progress) through a checkpoint read by the pipeline's source step -> a zero1 run on 4 devices
  -> a pipeline-zero1 run of 4 stages x 2 lanes: θ and Adam's state bit for bit at every hop,
  each run reading its own layout (the DP one with its layout's from_shards)."""
  from acco_jax.pipeline import build as pipe_build

  source = pipe_run(
    **{"pipeline.stages": 2, "pipeline.blocks_per_stage": "1,3", "pipeline.data_method": "acco"}
  )
  train = source.step
  state = train.init(jax.tree.map(jnp.asarray, model_params(source)))
  rows = train.microbatches_per_stage * 2
  rng = np.random.default_rng(0)
  for _ in range(4):  # fill, estimate, commit, estimate
    tok = rng.integers(0, source.model_cfg.V, (rows, 9), dtype=np.int32)
    state, _ = train.step(state, {"inputs": tok[:, :-1], "targets": tok[:, 1:]})
  saved = portable.to_host(state)
  with Checkpointer(tmp_path / "pipe", async_save=False) as ckpt:
    ckpt.save(4, state, extra={"stage": 4})
  config = tiny(
    gpt2_pipeline,
    **{
      "model.N": 4,
      "pipeline.stages": 2,
      "pipeline.data_method": "acco",
      "pipeline.blocks_per_stage": "1,3",
    },
  )
  reader = pipe_build.source_step(config, source.model_cfg, 8)
  with Checkpointer(tmp_path / "pipe", read_only=True) as ckpt:
    host, _ = ckpt.restore_host(None, lambda extra: reader.abstract_state(source.params_shapes))
  exported = reader.export_state(host)
  want = unpacked(source, saved)
  same_bits(exported.params, want["theta"], "pipeline theta")
  same_bits(exported.opt, want["opt"], "pipeline inner state")
  assert exported.updates == 1 and "estimate of the round in progress" in exported.dropped
  assert "2 flushes' gradients in flight" in exported.dropped

  zero1 = build.build(tiny(gpt2_zero1, **{"model.N": 4, "mesh.num_devices": 4}))
  into = portable.to_host(
    zero1.step.import_state(
      exported,
      1,
      streams.prime_batch(zero1, tiny(gpt2_zero1, **{"model.N": 4, "mesh.num_devices": 4})),
    )
  )
  got = view(into, zero1.step.layout)
  same_bits(got["theta"], want["theta"], "pipeline -> zero1 theta")
  same_bits(got["opt"], want["opt"], "pipeline -> zero1 inner state")

  back = zero1.step.export_state(into)
  target = pipe_run(**{"pipeline.data_method": "zero1"})  # 4 stages x 2 lanes, 1 block each
  assert target.step.packing.counts == (1, 1, 1, 1)
  placed = target.step.import_state(back, 1)
  assert tuple(jax.tree.leaves(placed.params)[0].sharding.spec) == ("stage", "data")
  got = unpacked(target, portable.to_host(placed))
  same_bits(got["theta"], want["theta"], "zero1 -> pipeline theta")
  same_bits(got["opt"], want["opt"], "zero1 -> pipeline inner state")
  placed, metrics = target.step.step(placed, {"inputs": tok[:16, :-1], "targets": tok[:16, 1:]})
  assert np.isfinite(float(metrics["loss"]))  # it trains on


def model_params(run):
  from acco_jax import model

  return model.init_params(run.model_cfg, 0)
