"""Heterogeneous budgets: the planner against brute force, the straggler simulation, and the budget
path through the trainer against a hand-written ACCO reference."""

import itertools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from acco_jax import model, parallel
from acco_jax.ckpt import checkpoint
from acco_jax.dp import hetero
from acco_jax.run import build, streams, trainer
from configs import gpt2_acco

# -- the planner ----------------------------------------------------------------------------------


def brute_force_makespan(t, total, k_max):
  """Smallest max_i b_i t_i over all budget vectors with sum == total, 1 <= b_i <= k_max."""
  best = np.inf
  for b in itertools.product(range(1, k_max + 1), repeat=len(t)):
    if sum(b) == total:
      best = min(best, max(bi * ti for bi, ti in zip(b, t, strict=True)))
  return best


@pytest.mark.parametrize(
  "t,base,k_max",
  [([1.0, 1.0, 1.0, 4.0], 2, 6), ([1.0, 2.0, 3.0, 1.5], 3, 5), ([0.5, 0.5, 0.5, 0.5], 2, 4)],
)
def test_balance_keeps_the_total_and_minimises_the_slowest(t, base, k_max):
  b = hetero.plan_budgets(t, 0.0, base=base, k_max=k_max, policy="balance")
  assert b.sum() == len(t) * base and b.min() >= 1 and b.max() <= k_max
  assert hetero.makespan(b, t) == pytest.approx(brute_force_makespan(t, len(t) * base, k_max))


def test_balance_with_one_worker_four_times_slower():
  b = hetero.plan_budgets([1, 1, 1, 4], 0.0, base=4, k_max=16, policy="balance")
  np.testing.assert_array_equal(b, [5, 5, 5, 1])  # 16 microbatches, the slow one finishes at 4
  assert hetero.makespan(b, [1, 1, 1, 4]) == 5 < 4 * 4  # equal budgets: the slow one takes 16


def test_fill_fills_the_window():
  t = [1.0, 1.0, 2.0, 4.0]
  # the slowest does the base (3 x 4 = 12 s); everyone else fills 12 s, capped at k_max
  np.testing.assert_array_equal(
    hetero.plan_budgets(t, 1.0, base=3, k_max=10, policy="fill"), [10, 10, 6, 3]
  )
  # a longer communication (20 s) raises every budget
  np.testing.assert_array_equal(
    hetero.plan_budgets(t, 20.0, base=3, k_max=30, policy="fill"), [20, 20, 10, 5]
  )


def test_policy_hysteresis_and_smoothing():
  policy = hetero.BudgetPolicy(4, base=4, k_max=16, policy="balance", hysteresis=0.1)
  assert not policy.observe([1.0, 1.0, 1.0, 1.05], 0.0)  # noise: plan unchanged
  np.testing.assert_array_equal(policy.budgets, [4, 4, 4, 4])
  assert policy.observe([1.0, 1.0, 1.0, 7.0], 0.0)  # smoothed slow time (1.05 + 7) / 2 ~ 4
  np.testing.assert_array_equal(policy.budgets, [5, 5, 5, 1])
  assert policy.budgets.sum() == 16


def test_bad_budget_specs_are_clear_errors():
  with pytest.raises(ValueError, match="need 4 integers >= 1"):
    hetero.parse_budgets("1,2,3", 4)
  with pytest.raises(ValueError, match="one integer per device"):
    hetero.parse_budgets("1,x,3,4", 4)
  with pytest.raises(ValueError, match="device 9 must be in"):
    hetero.parse_slowdown("9:0.1", 4)
  with pytest.raises(ValueError, match="choose one of balance, fill"):
    hetero.plan_budgets([1.0], 0.0, base=1, k_max=1, policy="fastest")


# -- the straggler simulation -------------------------------------------------------------------


def test_slowed_keeps_gradients_and_sleeps_only_on_its_worker():
  mesh = parallel.make_mesh(8)
  loss = lambda w, x: (jnp.sum(jnp.sin(w * x)), {"n": jnp.float32(1)})
  delays = np.zeros(8)
  delays[5] = 1.0  # far above what a loaded machine takes for the same call without the sleep
  slow = hetero.slowed(loss, delays, "data")

  def per_device(fn):
    def local(w, x):
      return jax.value_and_grad(fn, has_aux=True)(w, x[0])[1][None]

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))

  w, x = jnp.float32(0.7), jnp.arange(8, dtype=jnp.float32)
  plain, slowed = per_device(loss), per_device(slow)
  np.testing.assert_allclose(jax.device_get(slowed(w, x)), jax.device_get(plain(w, x)), rtol=1e-6)
  start = time.perf_counter()
  jax.block_until_ready(slowed(w, x))
  assert time.perf_counter() - start >= 1.0
  delays[5] = 0.0  # the callback reads the delays at run time: no sleep left
  start = time.perf_counter()
  jax.block_until_ready(slowed(w, x))
  assert time.perf_counter() - start < 0.9


# -- the budget path through the trainer ----------------------------------------------------------

BUDGETS = [2, 1, 2, 1, 1, 2, 2, 1]
LR = 0.05


def sgd_config():
  config = gpt2_acco.get_config("tiny")
  config.data.cache_dir = str(pathlib.Path(__file__).parent / ".." / ".pytest_cache" / "acco_data")
  config.model.dtype = config.comm_dtype = "float32"
  # one narrow block on short rows: compiling is most of the time, and the budgets do not need more
  config.model.D, config.model.N, config.model.H, config.data.seq_len = 16, 1, 1, 8
  config.train.eval_batches = 1
  config.opt.name, config.opt.b1, config.opt.clip_norm = "sgd", 0.0, 0.0
  config.opt.schedule, config.opt.warmup_updates, config.opt.lr = "constant", 0, LR
  config.opt.weight_decay = 0.0
  config.hetero.budgets = ",".join(map(str, BUDGETS))
  config.train.num_updates, config.train.eval_every, config.train.sample_tokens = 2, 0, 0
  config.ckpt.async_save = False
  return config


def reference_acco(config, run, num_stages):
  """ACCO with SGD from the algorithm doc, on whole pytrees: device i sums the gradients of the
  first b_i microbatches of its block; every update divides by the total count."""
  n, b, k_max = run.mesh.size, config.batch.microbatch_size, max(BUDGETS)
  grad = jax.jit(jax.grad(lambda p, mb: model.loss_fn(p, run.model_cfg, mb)[0]))
  add = lambda *trees: jax.tree.map(lambda *x: sum(x[1:], x[0]), *trees)
  prime = next(
    streams.batch_stream(run, config, run.tokens.train, n * b, seed=config.train.seed + 1)
  )
  stream = streams.batch_stream(
    run, config, run.tokens.train, n * k_max * b, seed=config.train.seed
  )
  theta = model.init_params(run.model_cfg, config.train.seed)
  rows = lambda batch, lo, hi: jax.tree.map(lambda x: x[lo:hi], batch)
  buf = add(*[grad(theta, rows(prime, i * b, (i + 1) * b)) for i in range(n)])
  count, w = n, theta
  for stage in range(num_stages):
    target = jax.tree.map(lambda p, g, c=count: p - LR * g / c, theta, buf)
    batch = next(stream)
    mbs = [
      rows(batch, (i * k_max + j) * b, (i * k_max + j + 1) * b)
      for i in range(n)
      for j in range(BUDGETS[i])
    ]
    new = add(*[grad(w, mb) for mb in mbs])
    if stage % 2 == 0:  # estimate: the accumulator keeps the buffer it shipped
      buf, count = add(buf, new), count + sum(BUDGETS)
    else:  # commit
      theta, buf, count = target, new, sum(BUDGETS)
    w = target
  return theta


@pytest.mark.slow  # ~36 s: a trainer run and its reference (the budgets' arithmetic: the unit tests above)
def test_unequal_budgets_through_the_trainer_match_the_reference(tmp_path):
  config = sgd_config()
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  run = build.build(config)
  with checkpoint.Checkpointer(str(tmp_path / "checkpoints")) as ckpt:
    state, _ = ckpt.restore(None, run.step.abstract_state(run.params_shapes))
  got = jax.device_get(run.step.params(state))
  want = reference_acco(config, run, summary["stages"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), got, want)
  # not vacuous: training moved the parameters well beyond the tolerance
  init = model.init_params(run.model_cfg, config.train.seed)
  pairs = zip(jax.tree.leaves(got), jax.tree.leaves(init), strict=True)
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
  assert moved > 1e-3
  logged = [r for r in trainer_rows(tmp_path) if "budgets" in r and "loss" in r]
  assert logged and all(r["budgets"] == BUDGETS and r["microbatches"] == 12 for r in logged)


def test_adaptive_budgets_are_probed_and_logged_through_the_trainer(tmp_path):
  """hetero.adaptive: the step probes at the process's first stage and every adapt_every stages,
  and every row carries the budgets its stage ran (one process times all its devices alike, so
  balance keeps the base budget: the planner's arithmetic is the unit tests' above). ~5 s."""
  config = sgd_config()
  config.hetero.budgets, config.hetero.adaptive, config.hetero.adapt_every = "", "balance", 2
  config.batch.microbatches, config.train.log_every = 6, 1  # 3 microbatches per stage
  trainer.train_and_evaluate(config, str(tmp_path))
  rows = trainer_rows(tmp_path)
  events = [r for r in rows if r.get("event") == "budgets"]
  assert [(e["stage"], e["budgets"]) for e in events] == [(0, [3] * 8), (2, [3] * 8)]
  logged = [r for r in rows if "loss" in r]
  assert [r["stage"] for r in logged] == [1, 2, 3, 4]
  assert all(r["budgets"] == [3] * 8 and r["microbatches"] == 24 for r in logged)


def trainer_rows(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# -- bench/dp/heterogeneous.py: its model part and its smoothing (the process part is the health test)


def test_heterogeneous_bench_model_and_smoothing():
  import argparse

  from bench.dp import heterogeneous as bench

  rows = bench.model_part(argparse.Namespace(factor=4.0))
  assert {r["workers"] for r in rows} == {8, 16, 32, 64}
  for r in rows:  # ZeRO-1 waits for the slowest: k * 4t + X; ACCO's balanced stage cannot beat
    assert r["zero1_s"] == pytest.approx(8 * 0.4 + r["comm_s"])  # the homogeneous one
    assert r["acco_homog_s"] <= r["acco_s"] < r["zero1_s"]
  # one update's worth of tokens decays the average by 0.8 whatever the logging interval
  tokens = [0, 10, 20]
  np.testing.assert_allclose(bench.smooth([1.0, 0.0, 0.0], tokens, 10), [1.0, 0.8, 0.64])
  np.testing.assert_allclose(bench.smooth([1.0, 0.0], [0, 20], 10), [1.0, 0.64])
