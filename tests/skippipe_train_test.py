"""Training with SkipPipe layer orders through the trainer's build (acco_jax.skippipe.orders).

* With the identity order (skip 0, no swaps) ZeRO-1 trains as it does without paths: another
  program (a scan over stacked blocks), so float tolerance. The steps are SGD's, whose size is
  proportional to the gradient: AdamW's first steps move a parameter by about the learning rate
  whatever its gradient's size, so a last-bit difference in a near-zero gradient (another
  program, another CPU's kernels) would become an lr-sized one.
* With skipped and swapped orders, one DDP step under SGD(lr) moves the weights by
  ``-lr x mean over microbatches of grad(loss with that microbatch's order)``, the gradient taken of
  a plain-JAX transformer written in tests/layers_test.py; a block no microbatch visits stays
  exactly where it was (its gradient is zero, and SGD adds nothing).
* A run stopped and resumed draws the same paths as an uninterrupted one (they are keyed by the
  restored data position), so it ends with the same parameters, bit for bit.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax import model, parallel
from acco_jax.run import build, streams, trainer
from acco_jax.skippipe import orders as orders_lib
from acco_jax.skippipe import paths
from configs import gpt2_skippipe
from tests.bad_input_test import CACHE
from tests.layers_test import _reference_loss

RTOL, ATOL = (
  2e-4,
  2e-6,
)  # float32; another program (per-device loops, an all-reduce) than the reference


def _config(method="zero1", stages=4, skip=0.0, swap=False, **opt):
  c = gpt2_skippipe.get_config("tiny")
  c.method = method
  c.data.cache_dir = str(CACHE)
  c.model.dtype = "float32"
  c.comm_dtype = "float32"
  c.pipeline.stages, c.pipeline.skip, c.pipeline.swap = stages, skip, swap
  c.pipeline.search_iters = 20
  c.opt.warmup_updates = 0
  for k, v in opt.items():
    c.opt[k] = v
  return c


def _batches(run, config, n):
  rows = run.mesh.size * run.step.num_microbatches * config.batch.microbatch_size
  stream = streams.batch_stream(run, config, run.tokens.train, rows, seed=0)
  if run.step.orders is not None:
    stream = orders_lib.OrderedStream(stream, run.step.orders)
  return [next(stream) for _ in range(n)]


def _train(stages):
  config = _config("zero1", stages=stages, name="sgd", lr=0.5, b1=0.9, schedule="constant")
  run = build.build(config)
  params = model.init_params(run.model_cfg, 0)
  state = run.step.init(params)
  losses = []
  for batch in _batches(run, config, 2):
    state, m = run.step.step(state, parallel.global_batch(batch, run.mesh))
    losses.append(float(m["loss"]))
  return run, jax.device_get(run.step.params(state)), losses


@pytest.mark.slow  # the skipped/swapped-orders test trains through the same path by default
def test_identity_order_trains_as_the_full_model():
  run, with_paths, loss_paths = _train(stages=4)
  assert run.step.orders is not None and set(run.step.orders.plan.paths) == {(1, 2, 3)}
  _, without, loss_plain = _train(stages=0)
  np.testing.assert_allclose(loss_paths, loss_plain, rtol=RTOL, atol=ATOL)
  assert loss_paths[1] < loss_paths[0] - 1e-3  # the first step moved the weights
  for a, b in zip(jax.tree.leaves(with_paths), jax.tree.leaves(without), strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_skipped_and_swapped_orders_move_exactly_the_expected_weights():
  lr = 0.5
  config = _config(
    "ddp",
    stages=4,
    skip=0.25,
    swap=True,
    name="sgd",
    lr=lr,
    b1=0.0,
    clip_norm=0.0,
    schedule="constant",
  )
  run = build.build(config)
  assert run.step.orders.k == 2
  params = model.init_params(run.model_cfg, 0)
  batch = _batches(run, config, 1)[0]
  B = config.batch.microbatch_size
  n_mb = batch["inputs"].shape[0] // B
  # two swapped orders that leave stage 1 (block 1) out: (3, 2) and (2, 3), alternating
  ps = [(3, 2) if g % 2 else (2, 3) for g in range(n_mb)]
  batch["order"] = run.step.orders.rows_for(ps)
  state = run.step.init(params)
  state, _ = run.step.step(state, parallel.global_batch(batch, run.mesh))
  after = jax.device_get(run.step.params(state))

  grad = jax.jit(jax.grad(_reference_loss), static_argnums=2)
  expected = jax.tree.map(np.zeros_like, params)
  for g, p in enumerate(ps):
    mb = {k: v[g * B : (g + 1) * B] for k, v in batch.items() if k != "order"}
    mb.setdefault("weights", np.ones(mb["targets"].shape, np.float32))
    order = tuple(int(i) for i in paths.layer_order(p, 4, 4))
    expected = jax.tree.map(
      lambda e, d: e + np.asarray(d) / n_mb, expected, grad(params, mb, order)
    )
  want = jax.tree.map(lambda p, e: np.asarray(p) - lr * e, params, expected)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(after), jax.tree.leaves(want), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  # block 1 was skipped by every microbatch: not one bit of it moved
  skipped = zip(
    jax.tree.leaves(after["blocks"]["1"]), jax.tree.leaves(params["blocks"]["1"]), strict=True
  )
  for a, b in skipped:
    np.testing.assert_array_equal(a, b)
  moved = jnp.abs(
    after["blocks"]["2"]["mlp_fc"]["kernel"] - params["blocks"]["2"]["mlp_fc"]["kernel"]
  )
  assert float(moved.max()) > 0


def test_random_paths_follow_the_batch_index():
  config = _config("zero1", stages=4, skip=0.5, swap=True)
  config.pipeline.paths = "random"
  run = build.build(config)
  a, b = run.step.orders.order_rows(3), run.step.orders.order_rows(3)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(run.step.orders.order_rows(3), run.step.orders.order_rows(4))
  assert a.shape == (run.mesh.size * run.step.num_microbatches, 2)  # B = 1; stage 0 + 1 stage
  assert (a[:, 0] == 0).all() and set(np.unique(a[:, 1])) <= {1, 2, 3}


@pytest.mark.slow  # two runs with paths (resume itself: train_test, pipeline_train_test)
def test_a_resumed_run_draws_the_same_paths(tmp_path):
  """Stopped after 3 of 8 stages and rerun, ACCO with random paths (new ones every iteration) ends
  where an uninterrupted run ends, bit for bit: resume reruns the same programs, so only the
  paths could differ, and they follow the restored data position, not a count kept in memory."""
  config = _config("acco", stages=4, skip=0.5, swap=True)
  config.pipeline.paths = "random"
  config.train.num_updates, config.train.log_every = 4, 1
  config.train.eval_every, config.train.sample_tokens = 0, 0
  config.ckpt.async_save = False
  finals = {}
  for name, stops in (("straight", [None]), ("resumed", [3, None])):
    for stop in stops:
      trainer.train_and_evaluate(
        config,
        str(tmp_path / name),
        max_stages=stop,
        on_params=lambda p, n=name: finals.update({n: p}),
      )
  for a, b in zip(
    jax.tree.leaves(finals["straight"]), jax.tree.leaves(finals["resumed"]), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  run = build.build(config)  # the paths change from iteration to iteration (or this shows nothing)
  assert not np.array_equal(run.step.orders.order_rows(2), run.step.orders.order_rows(3))
  events = [
    json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
  ]
  assert [e["stage"] for e in events if e.get("event") == "restored"] == [3]
