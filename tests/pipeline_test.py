"""acco_jax.pipeline.ticks and .step: schedules of paths, run as a pipeline over the ``stage`` axis.

The pipeline's loss and gradients are compared with the single-device computation
(``layers.loss_fn_ordered``, itself tested against a plain-jax block in layers_test.py) averaged over
the microbatches, each with the layer order written out here from its path. Another program (a
pipeline of ppermutes and per-stage vjps against one jax.grad), so float32 tolerance, not bits.
"""

import jax
import numpy as np
import pytest

from acco_jax import layers, model
from acco_jax.analysis import hlo
from acco_jax.pipeline import programs as pipe
from acco_jax.pipeline import ticks
from acco_jax.skippipe import assign, schedule, simulate, topology

CFG = model.get_config("tiny", N=4, dtype="float32")
S = 4
RTOL, ATOL = 1e-5, 1e-6  # float32, the same operations composed in another program
FULL = [(1, 2, 3)] * 6
# full, skipped, swapped, skipped+swapped, empty (stage 0 only) and one-stage paths
MIXED = [(1, 2, 3), (2, 3), (3, 1), (), (2,), (3, 2, 1)]


@pytest.fixture(scope="module")
def params():
  return model.init_params(CFG, 0)


def _batch(m, rows, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CFG.V, size=(m, rows, 17), dtype=np.int32)
  weights = (rng.random((m, rows, 16)) < 0.9).astype(np.float32)
  return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "weights": weights}


def _order(path):
  per = CFG.N // S
  return np.array([b for s in (0, *path) for b in range(s * per, (s + 1) * per)], np.int32)


@jax.jit
def _loss_and_grad(params, batch, order):  # one compile per order length
  return jax.value_and_grad(lambda p: layers.loss_fn_ordered(p, CFG, batch, order)[0])(params)


def _reference(params, batch, paths, lanes):
  """Mean over lanes and microbatches of the single-device loss and gradient."""
  rows = batch["inputs"].shape[1] // lanes
  total = None
  for lane in range(lanes):
    for m, path in enumerate(paths):
      b = {k: v[m, lane * rows : (lane + 1) * rows] for k, v in batch.items()}
      out = _loss_and_grad(params, b, _order(path))
      total = out if total is None else jax.tree.map(np.add, total, out)
  return jax.tree.map(lambda v: np.asarray(v) / (lanes * len(paths)), total)


def _run(params, paths, policy, lanes, devices=8):
  sched = ticks.build(paths, S, policy)
  mesh = pipe.make_mesh(S, lanes, jax.devices()[:devices])
  batch = _batch(len(paths), 2 * lanes)
  pk = pipe.packing_for(params, S, lanes=lanes)
  fn = jax.jit(pipe.make_loss_and_grad(CFG, mesh, sched, pk))
  args = (pipe.place_params(pk.pack(params), mesh), pipe.place_batch(batch, mesh))
  compiled = fn.lower(*args).compile()
  loss, grads = compiled(*args)
  return sched, batch, loss, pk.unpack(jax.device_get(grads)), compiled.as_text()


def _assert_equal(params, batch, paths, lanes, loss, grads):
  ref_loss, ref_grads = _reference(params, batch, paths, lanes)
  np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
  for path, g in jax.tree_util.tree_leaves_with_path(ref_grads):
    np.testing.assert_allclose(
      np.asarray(_get(grads, path)), g, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path)
    )


def _get(tree, path):
  for k in path:
    tree = tree[k.key]
  return tree


# ----------------------------------------------------------------------------------------- ticks


def _replay(sched):
  """Checks the tables by replaying them: every operation reads the tensor its chain needs."""
  S_, T = sched.num_stages, sched.num_ticks
  slot = [dict() for _ in range(S_)]  # slot -> (microbatch, op index whose output it holds)
  saved = {}  # (microbatch, op index of F) -> slot on that stage
  done = {m: 0 for m in range(sched.num_microbatches)}
  for t in range(T):
    outs = {}
    for s in range(S_):
      k, m = int(sched.kind[t, s]), int(sched.mb[t, s])
      if k == ticks.IDLE:
        continue
      chain = ticks.chain(sched.paths[m])
      i = done[m]
      assert chain[i] == (k, s), (t, s, chain[i], (k, s))
      if k in (ticks.F, ticks.H):
        assert slot[s].get(int(sched.slot_x[t, s])) == (m, i - 1)
        if k == ticks.F:
          saved[(m, i)] = int(sched.slot_x[t, s])
      if k in (ticks.B, ticks.B0):
        assert slot[s].get(int(sched.slot_g[t, s])) == (m, i - 1)
      if k == ticks.B:
        j = len(chain) - 1 - i
        assert int(sched.slot_x[t, s]) == saved[(m, j)]
        assert slot[s][saved[(m, j)]] == (m, j - 1)
      outs[s] = (m, i)
      done[m] = i + 1
    for s, item in outs.items():
      if sched.local[t, s] != sched.slots:
        slot[s][int(sched.local[t, s])] = item
    for r in range(sched.perm.shape[1]):
      for src, dst in sched.perms[sched.perm[t, r]]:
        slot[dst][int(sched.recv[t, r, dst])] = outs[src]
  assert all(done[m] == len(ticks.chain(p)) for m, p in enumerate(sched.paths))


def test_two_stage_gpipe_by_hand():
  # S=2, M=2: t0 F0(0) | t1 F0(1), F(0) | t2 H(0), F(1) | t3 H(1), B(0) | t4 B0(0), B(1) | t5 B0(1)
  sched = ticks.build([(1,), (1,)], 2, "gpipe")
  assert sched.num_ticks == 6
  assert sched.idle_fraction() == pytest.approx(2 / 12)
  assert [ticks.KIND_NAMES[k] for k in sched.kind[:, 0]] == ["F0", "F0", "H", "H", "B0", "B0"]
  assert [ticks.KIND_NAMES[k] for k in sched.kind[:, 1]] == ["idle", "F", "F", "B", "B", "idle"]
  # M=3: H goes by microbatch rank before a later F0; stage 1 may not start B0 before its last F
  # (t3, t4 idle), stage 0 waits for the last activation (t5 idle)
  sched = ticks.build([(1,)] * 3, 2, "gpipe")
  names = lambda s: [ticks.KIND_NAMES[k] for k in sched.kind[:, s]]
  assert names(0) == ["F0", "F0", "H", "H", "F0", "idle", "H", "B0", "B0", "B0"]
  assert names(1) == ["idle", "F", "F", "idle", "idle", "F", "B", "B", "B", "idle"]
  assert list(sched.mb[:, 0]) == [0, 1, 0, 1, 2, 0, 2, 0, 1, 2]


@pytest.mark.parametrize("policy", ticks.POLICIES)
@pytest.mark.parametrize("paths", [FULL, MIXED, MIXED[::-1] * 2])
def test_tables_replay(paths, policy):
  _replay(ticks.build(paths, S, policy))


def test_1f1b_bounds_memory_and_priority_orders_collisions():
  full = [(1, 2, 3)] * 12
  gpipe, one = ticks.build(full, S, "gpipe"), ticks.build(full, S, "1f1b")
  assert one.slots < gpipe.slots
  # stage 0 runs F0 in the given priority order
  order = [5, 4, 3, 2, 1, 0]
  sched = ticks.build([(1,)] * 6, 2, "gpipe", priority=[order, order])
  f0 = [int(sched.mb[t, 0]) for t in range(sched.num_ticks) if sched.kind[t, 0] == ticks.F0]
  assert f0 == order


# -------------------------------------------------------------------------------------- pipeline


@pytest.mark.parametrize(
  "paths,policy,lanes,devices",
  [  # in the default run the skipped and swapped paths over 2 lanes: the others in the slow step
    pytest.param(FULL, "gpipe", 1, 4, marks=pytest.mark.slow),
    pytest.param(FULL, "1f1b", 1, 4, marks=pytest.mark.slow),
    pytest.param(MIXED, "gpipe", 1, 4, marks=pytest.mark.slow),
    (MIXED, "1f1b", 2, 8),
  ],
  ids=["full-gpipe-4dev", "full-1f1b-4dev", "skip-swap-gpipe-4dev", "skip-swap-1f1b-2lanes-8dev"],
)
def test_pipeline_equals_single_device(params, paths, policy, lanes, devices):
  sched, batch, loss, grads, text = _run(params, paths, policy, lanes, devices)
  _assert_equal(params, batch, paths, lanes, loss, grads)
  # the compiled collective-permutes move data only between consecutive nodes of some path
  allowed = set()
  for path in paths:
    nodes = (0, *path, 0)
    for a, b in ((a, b) for a, b in zip(nodes, nodes[1:], strict=False) if a != b):
      allowed |= {(lane * S + a, lane * S + b) for lane in range(lanes)}
      allowed |= {(lane * S + b, lane * S + a) for lane in range(lanes)}
  permutes = [c for c in hlo.hlo_collectives(text) if c.kind == "collective-permute"]
  assert permutes
  moved = {tuple(p) for c in permutes for p in c.groups}
  assert moved <= allowed, sorted(moved - allowed)
  assert {(a, b) for a, b in moved if a < S and b < S} == sched.pairs()


# --------------------------------------------------------------- the scheduler's plan, mesh-wide


def _plan(lanes, stages, skip, seed):
  """A scheduled plan for ``lanes x stages`` nodes of the geo preset, 3 microbatches per lane."""
  topo = topology.preset("geo", lanes * stages, seed=seed)
  costs = simulate.transformer_costs(stages, 24, 2048, 32000, 1024, 4, 1e14, 2)
  part = assign.assign(topo, costs, stages, seed=0, equal=True)
  return part, schedule.schedule(topo, costs, part, 3 * lanes, skip, True, seed=0, iters=30)


def _column(part, node):
  """Device ``lane * S + stage`` of a node, written out from the partition."""
  for s, nodes in enumerate(part):
    if node in nodes:
      return nodes.index(node) * len(part) + s
  raise AssertionError(node)


@pytest.mark.parametrize(
  "lanes,stages,skip,seed",
  [(2, 4, 0.25, 1), pytest.param(4, 2, 0.0, 3, marks=pytest.mark.slow)],
)  # by default the skipping plan, whose microbatches change lanes too; no skip: the slow step
def test_scheduled_plan_runs_across_lanes(params, lanes, stages, skip, seed):
  part, plan = _plan(lanes, stages, skip, seed)
  routes = [
    [_column(part, x) for x in (o, *n, o, *reversed(n), o)]
    for o, n in zip(plan.origin, plan.nodes, strict=True)
  ]
  assert any(len({c // stages for c in r}) > 1 for r in routes), "no microbatch changes lanes"
  sched = ticks.from_plan(plan, part)
  # every device runs its node's steps in the plan's order, read back from the kind and microbatch
  # tables alone: a microbatch's operations run one after another, so their count is the step
  done, seen = {}, [[] for _ in range(lanes * stages)]
  for t in range(sched.num_ticks):
    ran = [(c, int(sched.mb[t, c])) for c in range(lanes * stages) if sched.kind[t, c]]
    for c, m in ran:
      assert routes[m][done.get(m, 0)] == c  # the step runs on the device its route gives
      seen[c].append((m, done.get(m, 0)))
    for _, m in ran:
      done[m] = done.get(m, 0) + 1
  for c in range(lanes * stages):
    assert seen[c] == [tuple(x) for x in plan.order[part[c % stages][c // stages]]], c
    assert sched.order(c) == seen[c]

  # the loss and gradients: the mean over microbatches of each one's ordered loss, its whole rows
  cfg = model.get_config("tiny", N=4, dtype="float32")
  mesh = pipe.make_mesh(stages, lanes, jax.devices()[: lanes * stages])
  batch = _batch(len(plan.paths), 2, seed=seed)
  pk = pipe.packing_for(params, stages, lanes=lanes)
  fn = jax.jit(pipe.make_loss_and_grad(cfg, mesh, sched, pk))
  args = (pipe.place_params(pk.pack(params), mesh), pipe.place_batch(batch, mesh, sched))
  compiled = fn.lower(*args).compile()
  loss, grads = compiled(*args)
  per = cfg.N // stages
  total = None
  for m, path in enumerate(plan.paths):
    order = np.array([b for s in (0, *path) for b in range(s * per, (s + 1) * per)], np.int32)
    b = {k: v[m] for k, v in batch.items()}
    out = _loss_and_grad(params, b, order)
    total = out if total is None else jax.tree.map(np.add, total, out)
  ref_loss, ref_grads = jax.tree.map(lambda v: np.asarray(v) / len(plan.paths), total)
  np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
  got = pk.unpack(jax.device_get(grads))
  for path, g in jax.tree_util.tree_leaves_with_path(ref_grads):
    np.testing.assert_allclose(
      np.asarray(_get(got, path)), g, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path)
    )
  # the compiled collective-permutes move data exactly over the consecutive hops of the routes
  hops = {(a, b) for r in routes for a, b in zip(r, r[1:], strict=False) if a != b}
  permutes = [c for c in hlo.hlo_collectives(compiled.as_text()) if c.kind == "collective-permute"]
  assert {tuple(p) for c in permutes for p in c.groups} == hops


def test_bench_bubble_table_smoke(tmp_path):
  import json
  import pathlib
  import subprocess
  import sys

  repo = pathlib.Path(__file__).resolve().parent.parent
  out = tmp_path / "pipeline.json"
  cmd = [
    sys.executable,
    "-m",
    "bench.pipeline.pipeline",
    "--parts",
    "bubbles",
    "--out",
    str(out),
  ]
  proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads(out.read_text())["bubbles"]["rows"]
  assert {r["schedule"] for r in rows} >= {"gpipe", "1f1b", "skippipe-1f1b"}
  for r in rows:  # every microbatch's 2k + 3 operations run once: full paths have k = S - 1
    if r["paths"] == "full":
      assert r["busy_ops"] == r["M"] * (2 * (r["S"] - 1) + 3)


@pytest.mark.slow
def test_scheduled_plan_reduces_over_lanes_like_the_mean(params):
  """Mesh-wide tables with the lanes' data methods: ZeRO-1's reduce-scatter gives each lane its
  slice of the mean gradient, ACCO's per-lane shares sum to it."""
  lanes, stages = 4, 2
  part, plan = _plan(lanes, stages, 0.0, 3)
  sched = ticks.from_plan(plan, part)
  cfg = model.get_config("tiny", N=4, dtype="float32")
  mesh = pipe.make_mesh(stages, lanes, jax.devices()[: lanes * stages])
  batch = pipe.place_batch(_batch(len(plan.paths), 2, seed=3), mesh, sched)
  pk = pipe.packing_for(params, stages, lanes=lanes)
  packed = pipe.place_params(pk.pack(params), mesh)
  out = {
    r: jax.jit(pipe.make_loss_and_grad(cfg, mesh, sched, pk, r))(packed, batch)
    for r in ("mean", "scatter", "none")
  }
  loss, mean = out["mean"]
  for r in ("scatter", "none"):
    np.testing.assert_allclose(out[r][0], loss, rtol=1e-6)
  scattered = out["scatter"][1]
  assert tuple(jax.tree.leaves(scattered)[0].sharding.spec) == ("stage", "data")
  for g in mean:
    np.testing.assert_allclose(scattered[g], mean[g], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.sum(out["none"][1][g], axis=0), mean[g], rtol=1e-5, atol=1e-7)


def _bench_pipeline():
  from bench.pipeline import pipeline

  return pipeline


def test_bench_memory_rows_and_table():
  """The AOT memory table's rows, topologies and table, without compiling anything."""
  bench = _bench_pipeline()
  rows = bench.memory_plan()
  assert len(rows) == 2 * 2 * (2 * 3 + 1) and len({bench.row_key(r) for r in rows}) == len(rows)
  assert sum(r.get("split") == "equal" for r in rows) == 4  # a control per (model, S)
  assert all(bench.parse_row(bench.row_key(r)) == r for r in rows)
  short = bench.memory_plan("lanes2", controls=False)
  assert len(short) == 2 * 2 * (1 + 3)  # one lane: ddp only
  assert (
    bench.topology(4) == (8, 1) and bench.topology(8) == (8, 1) and bench.topology(16) == (16, 2)
  )
  done = {
    **rows[0],
    "model": "m",
    "topology": "1x8",
    "blocks": "1,4,4,3",
    "held_M": 46.5,
    "idle_M": 25.3,
    "state_GiB": 0.5,
    "argument_GiB": 0.5,
    "temp_GiB": 3.9,
    "output_GiB": 0.5,
    "total_GiB": 4.4,
    "compile_s": 20,
  }
  table = bench.memory_table([done, {**rows[1], "not_possible": "not possible (12 blocks)"}])
  assert " 1,4,4,3 |" in table and "not possible (12 blocks)" in table and "3.90" in table


def _run_bench(args, tmp_path, timeout):
  import subprocess

  from bench import common

  cmd = common.module_command("bench.pipeline.pipeline", *args)
  proc = subprocess.run(
    cmd, cwd=tmp_path, env=common.child_env(), capture_output=True, text=True, timeout=timeout
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def test_bench_memory_without_plugin_says_skipped(tmp_path):
  from acco_jax import parallel

  if parallel.has_cuda_plugin():
    pytest.skip("the CUDA PJRT plugin is installed here: --parts aot would compile every row")
  out = tmp_path / "memory.json"
  proc = _run_bench(
    ["--parts", "aot", "--out", str(tmp_path / "p.json"), "--memory-out", str(out)], tmp_path, 120
  )
  assert "AOT: skipped: no CUDA PJRT plugin" in proc.stdout


def test_bench_memory_one_row_at_toy_widths(tmp_path):
  """One acco row on 2 lanes x 4 stages at toy widths: the worker's JSON (needs the plugin)."""
  import json

  from acco_jax import parallel

  if not parallel.has_cuda_plugin():
    pytest.skip("no CUDA PJRT plugin (jax-cuda12-pjrt): nothing to compile for")
  out = tmp_path / "row.json"
  _run_bench(
    [
      "--worker",
      str(out),
      "--kind",
      "aot",
      "--row",
      "gpt2:4:2:acco",
      "--smoke",
      "--microbatches",
      "2",
      "--rows",
      "1",
    ],
    tmp_path,
    300,
  )
  from acco_jax.pipeline import packing

  row = json.loads(out.read_text())
  counts = packing.balanced_counts(_bench_pipeline().model_config("gpt2", smoke=True), 4)
  assert row["blocks"] == ",".join(map(str, counts)) and row["topology"] == "1x8"
  assert set(row["state_fields_GiB"]) >= {"params", "opt_state", "w", "buf"}
  assert row["temp_GiB"] >= 0 and row["argument_GiB"] > 0 and row["compile_s"] >= 0
