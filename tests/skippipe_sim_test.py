"""SkipPipe's host side: topology, stage assignment, the iteration simulator and the path scheduler.

The simulator is checked against makespans computed by hand in the comments; the scheduler and the
assignment against the baselines they must beat (random valid plans, the full pipeline, random
partitions), all priced by the simulator, which the hand-computed cases pin down.
"""

import json

import numpy as np
import pytest

from acco_jax import errors
from acco_jax.skippipe import (
  assign,
  baselines,
  bounds,
  left_out,
  paths,
  schedule,
  simulate,
  topology,
)


def _topo(latency, bandwidth, speed=None):
  lat = np.asarray(latency, float)
  m = lat.shape[0]
  return topology.Topology(
    "test",
    np.ones(m) if speed is None else np.asarray(speed, float),
    np.zeros(m, np.int32),
    lat,
    np.asarray(bandwidth, float),
  )


def test_two_stages_two_microbatches_by_hand():
  # nodes A (stage 0) and B (stage 1), 0.5 s latency, no bytes; F = 1 s a stage, H = 3 x 0.5 s,
  # B = 2 s a stage. GPipe on A: F0(0) [0,1] F0(1) [1,2]; on B: F1(0) [1.5,2.5] F1(1) [2.5,3.5];
  # A: H(0) [3,4.5] H(1) [4.5,6]; B (after its forwards): B1(0) [5,7] B1(1) [7,9];
  # A: B0(0) [7.5,9.5] B0(1) [9.5,11.5]  -> 11.5 s
  topo = _topo([[0, 0.5], [0.5, 0]], [[np.inf, 1], [1, np.inf]])
  costs = simulate.Costs(fwd_S=np.array([1.0, 1.0]), head=0.5, act_bytes=0.0)
  routes = [simulate.Route(0, (1,), (1,))] * 2
  for policy in simulate.POLICIES:
    res = simulate.simulate(topo, costs, routes, policy)
    assert res.makespan == pytest.approx(11.5), policy
  res = simulate.simulate(topo, costs, routes, "gpipe")
  np.testing.assert_allclose(res.start[1], [1, 2.5, 4.5, 7, 9.5])
  assert res.order[0] == ((0, 0), (1, 0), (0, 2), (1, 2), (0, 4), (1, 4))


def test_fill_drain_waits_where_fifo_does_not():
  # Origins A1, A2, stage-1 node B; the A2 <-> B link has 2 s latency, the others none; F = 1 s,
  # head 0, B = 2 s. mb 0 (from A1) is back at B for its backward at 2 s; mb 1 reaches B at 3 s.
  # fifo:  B: F(0) [1,2] B(0) [2,4] F(1) [4,5]; mb 1: H at 7, B(1) [9,11], B0(1) [13,15]   -> 15 s
  # gpipe: B: F(0) [1,2] F(1) [3,4] B(0) [4,6]; mb 1: H at 6, B(1) [8,10], B0(1) [12,14]   -> 14 s
  lat = np.zeros((3, 3))
  lat[1, 2] = lat[2, 1] = 2.0
  topo = _topo(lat, np.full((3, 3), np.inf))
  costs = simulate.Costs(fwd_S=np.array([1.0, 1.0]), head=0.0, act_bytes=0.0)
  routes = [simulate.Route(0, (1,), (2,)), simulate.Route(1, (1,), (2,))]
  fifo = simulate.simulate(topo, costs, routes, "fifo")
  gpipe = simulate.simulate(topo, costs, routes, "gpipe")
  assert fifo.makespan == pytest.approx(15.0)
  assert gpipe.makespan == pytest.approx(14.0)
  assert fifo.order[2] == ((0, 1), (0, 3), (1, 1), (1, 3))
  assert gpipe.order[2] == ((0, 1), (1, 1), (0, 3), (1, 3))


def test_collision_waits():
  # two origins, one stage-1 node B, no latency, F = 1 s, head 0, B = 2 s.
  # B: F(0) [1,2] F(1) [2,3] (waits 1 s), B(0) [3,5] B(1) [5,7]; B0(1) on A2 [7,9] -> 9 s.
  # With a node each the microbatches never meet: 1 + 1 + 2 + 2 = 6 s.
  topo = _topo(np.zeros((4, 4)), np.full((4, 4), np.inf))
  costs = simulate.Costs(fwd_S=np.array([1.0, 1.0]), head=0.0, act_bytes=0.0)
  shared = [simulate.Route(0, (1,), (2,)), simulate.Route(1, (1,), (2,))]
  apart = [simulate.Route(0, (1,), (2,)), simulate.Route(1, (1,), (3,))]
  assert simulate.simulate(topo, costs, shared).makespan == pytest.approx(9.0)
  assert simulate.simulate(topo, costs, apart).makespan == pytest.approx(6.0)


def test_stage_allreduce_by_hand():
  # Collision case's nodes: origins A1, A2 (stage 0), B1, B2 (stage 1); no latency inside stage 0,
  # B1 <-> B2 0.5 s latency and 4 MB/s; 8 MB of stage-1 gradients, 2 MB of stage 0's.
  # Pipeline as in test_collision_waits. apart: each B node runs F [1,2] B [2,4], each origin ends
  # at 6 s. shared: B1 runs F(0) [1,2] F(1) [2,3] B(0) [3,5] B(1) [5,7], A2 ends at 9 s, B2 idle.
  # Ring of k = 2: 2 (k-1) (latency + bytes / k / bandwidth): stage 1 2 (0.5 + 4 MB / 4 MB/s) = 3 s,
  # stage 0 (infinite bandwidth, no latency) 0 s; a stage starts when all its nodes are done.
  # apart: max(6 + 0, 4 + 3) = 7 s; shared: max(9 + 0, 7 + 3) = 10 s.
  lat = np.zeros((4, 4))
  lat[2, 3] = lat[3, 2] = 0.5
  bw = np.full((4, 4), np.inf)
  bw[2, 3] = bw[3, 2] = 4e6
  topo = _topo(lat, bw)
  costs = simulate.Costs(
    fwd_S=np.array([1.0, 1.0]), head=0.0, act_bytes=0.0, grad_bytes_S=np.array([2e6, 8e6])
  )
  part = [[0, 1], [2, 3]]
  assert simulate.ring_allreduce_s(topo, [2, 3], 8e6) == pytest.approx(3.0)
  assert simulate.ring_allreduce_s(topo, [2], 8e6) == 0.0
  shared = [simulate.Route(0, (1,), (2,)), simulate.Route(1, (1,), (2,))]
  apart = [simulate.Route(0, (1,), (2,)), simulate.Route(1, (1,), (3,))]
  res = simulate.simulate(topo, costs, apart, partition=part)
  assert (res.pipeline_s, res.makespan) == (pytest.approx(6.0), pytest.approx(7.0))
  res = simulate.simulate(topo, costs, shared, partition=part)
  assert (res.pipeline_s, res.makespan) == (pytest.approx(9.0), pytest.approx(10.0))
  assert simulate.simulate(topo, costs, apart).makespan == pytest.approx(6.0)  # no partition
  order = simulate.simulate(topo, costs, apart, partition=part).order
  assert simulate.replay(topo, costs, apart, order, part).makespan == pytest.approx(7.0)
  # The scheduler, with the all-reduce in its objective, finds the 7 s plan
  plan = schedule.schedule(topo, costs, part, 2, 0.0, False, seed=0, iters=50)
  assert plan.makespan == pytest.approx(7.0)


def test_slow_link_and_the_scheduler_avoids_it():
  # 1 MB of activations. A -> B1: 1 GB/s, no latency (1 ms a hop); A -> B2: 0.1 s + 1 MB / 1 MB/s.
  # Via B2: 1 + 1.1 + 1 + 1.1 + 0 + 1.1 + 2 + 1.1 + 2 = 10.4 s; via B1: 6 + 4 x 0.001 = 6.004 s.
  lat = [[0, 0, 0.1], [0, 0, 0], [0.1, 0, 0]]
  bw = [[np.inf, 1e9, 1e6], [1e9, np.inf, 1e9], [1e6, 1e9, np.inf]]
  topo = _topo(lat, bw)
  costs = simulate.Costs(fwd_S=np.array([1.0, 1.0]), head=0.0, act_bytes=1e6)
  slow = simulate.simulate(topo, costs, [simulate.Route(0, (1,), (2,))]).makespan
  fast = simulate.simulate(topo, costs, [simulate.Route(0, (1,), (1,))]).makespan
  assert slow == pytest.approx(10.4)
  assert fast == pytest.approx(6.004)
  plan = schedule.schedule(topo, costs, ((0,), (1, 2)), 1, skip=0.0, swap=False, iters=20)
  assert plan.nodes == ((1,),) and plan.makespan == pytest.approx(6.004)


GEO = topology.preset("geo", topology.default_nodes(4), seed=0)
COSTS = simulate.transformer_costs(4, 8, 1024, 32000, 1024, 4, 1e14)


@pytest.fixture(scope="module")
def partition():
  return assign.assign(GEO, COSTS, 4, seed=0)


def test_replay_of_the_recorded_order_reproduces_the_makespan(partition):
  for policy, plan in [
    ("fifo", baselines.random_plan(GEO, COSTS, partition, 8, 0.5, True, seed=1)),
    ("gpipe", baselines.full_pipeline(GEO, COSTS, partition, 8, "gpipe")),
    ("1f1b", baselines.full_pipeline(GEO, COSTS, partition, 8, "1f1b")),
  ]:
    res = simulate.replay(GEO, COSTS, plan.routes(), plan.order)
    assert res.makespan == pytest.approx(plan.makespan), policy
  bad = [tuple(reversed(o)) for o in plan.order]
  with pytest.raises(ValueError, match="deadlock"):
    simulate.replay(GEO, COSTS, plan.routes(), bad)


def test_assignment_beats_random_and_is_seeded(partition):
  rnd = [
    assign.cost(GEO, COSTS, assign.random_partition(GEO.num_nodes, 4, np.random.default_rng(i)))
    for i in range(20)
  ]
  best = assign.cost(GEO, COSTS, partition)
  assert best < 0.8 * np.median(rnd), (best, np.median(rnd))
  assert assign.assign(GEO, COSTS, 4, seed=0) == partition
  assert [len(p) for p in partition] == assign.stage_sizes(GEO.num_nodes, 4)


def test_assignment_prices_the_stage_allreduce():
  # Regions {0, 1} and {2, 3}: 0.1 s and 10 MB/s between them, free inside. Two stages of two
  # nodes. By round trip alone each stage spans both regions (lanes 0 -> 1 and 2 -> 3 never cross:
  # cost 0), and each stage's 100 MB ring crosses: 2 (0.1 + 50 MB / 10 MB/s) = 10.2 s. Priced with
  # the all-reduce, each stage stays in a region: every round trip crosses twice, 2 x (0.1 + 1 MB /
  # 10 MB/s) = 0.4 s, and the rings are free.
  far = np.array([[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]], bool)
  topo = _topo(np.where(far, 0.1, 0.0), np.where(far, 1e7, np.inf))
  costs = simulate.Costs(fwd_S=np.array([1.0, 1.0]), head=0.0, act_bytes=1e6)
  priced = simulate.Costs(costs.fwd_S, 0.0, 1e6, grad_bytes_S=np.array([1e8, 1e8]))
  split = assign.assign(topo, costs, 2, seed=0)
  whole = assign.assign(topo, priced, 2, seed=0)
  assert sorted(split) == [(0, 2), (1, 3)] or sorted(split) == [(0, 3), (1, 2)], split
  assert sorted(whole) == [(0, 1), (2, 3)], whole
  assert assign.cost(topo, costs, split) == 0.0
  assert assign.cost(topo, priced, split) == pytest.approx(10.2)
  assert assign.cost(topo, priced, whole) == pytest.approx(0.4)
  routes = simulate.lanes(topo, priced, whole, 2)
  assert (
    simulate.simulate(topo, priced, routes, partition=whole).makespan
    < simulate.simulate(
      topo, priced, simulate.lanes(topo, priced, split, 2), partition=split
    ).makespan
  )


@pytest.mark.parametrize("skip,swap", [(0.0, False), (0.25, True), (0.5, False), (0.5, True)])
def test_scheduler_beats_random_and_the_full_pipeline(partition, skip, swap):
  n = 8
  plan = schedule.schedule(GEO, COSTS, partition, n, skip, swap, seed=0, iters=150)
  k = paths.path_length(4, skip)
  c, m = schedule.limits(partition, n, k)
  # the plan is valid: path lengths, order unless swaps, memory and balance
  load = np.zeros(GEO.num_nodes, int)
  visits = np.zeros(4, int)
  for o, p, ys in zip(plan.origin, plan.paths, plan.nodes, strict=True):
    assert len(p) == k and o in partition[0] and (swap or list(p) == sorted(p))
    assert all(y in partition[s] for s, y in zip(p, ys, strict=True))
    load[[o, *ys]] += 1
    visits[list(p)] += 1
  assert load.max() <= m and visits[1:].max() <= c
  rnd = [
    baselines.random_plan(GEO, COSTS, partition, n, skip, swap, seed=i).makespan for i in range(5)
  ]
  full = min(
    baselines.full_pipeline(GEO, COSTS, partition, n, p).makespan for p in ("gpipe", "1f1b")
  )
  assert plan.makespan < min(rnd)
  if skip == 0.0:
    assert plan.makespan <= full * (1 + 1e-9)  # the lanes are one of its starts
  else:
    assert plan.makespan < 0.9 * full, (plan.makespan, full)


def test_topology_presets_and_file(tmp_path):
  geo = topology.preset("geo", 20, seed=3)
  off = ~np.eye(20, dtype=bool)
  between = geo.region_M[:, None] != geo.region_M[None, :]
  assert 0.010 <= geo.latency_MxM[between].min() and geo.latency_MxM[between].max() <= 0.250
  assert 0.1 * topology.GBIT * (1 - 1e-9) <= geo.bandwidth_MxM[off & between].min()  # rounding
  assert geo.bandwidth_MxM[off & between].max() <= topology.GBIT
  np.testing.assert_array_equal(geo.latency_MxM, topology.preset("geo", 20, seed=3).latency_MxM)
  f = tmp_path / "mine.json"
  f.write_text(
    json.dumps(
      {
        "speed": [1, 0.5],
        "region": ["eu", "us"],
        "latency_ms": [[0, 80], [80, 0]],
        "bandwidth_gbps": [[0, 1], [1, 0]],
      }
    )
  )
  topo = topology.get(str(f), 2)
  assert topo.transfer_MxM(topology.GBIT)[0, 1] == pytest.approx(1.08)
  f.write_text("{not json")
  with pytest.raises(errors.UserValueError, match="does not parse as JSON"):
    topology.get(str(f), 2)


def test_bench_sim_smoke(tmp_path):
  # python -m bench.pipeline.skippipe --part sim (and sim-allreduce, timeline) --smoke: the iteration-time tables
  # on one small geo case, and the timeline figure
  import subprocess
  import sys
  from pathlib import Path

  repo = Path(__file__).resolve().parent.parent
  for part in ("sim", "sim-allreduce", "timeline"):
    cmd = [
      sys.executable,
      "-m",
      "bench.pipeline.skippipe",
      "--part",
      part,
      "--smoke",
      "--out",
      str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
  data = json.loads((tmp_path / "skippipe_sim.json").read_text())
  assert data["benchmark"] == "skippipe_sim" and len(data["rows"]) == 4
  for row in data["rows"]:
    assert row["bound_s"] <= row["scheduler_s"] < row["random_s"]
  assert (tmp_path / "skippipe_timeline.png").stat().st_size > 1000
  data = json.loads((tmp_path / "skippipe_sim_allreduce.json").read_text())
  assert len(data["rows"]) == 4  # skip 0 and 0.5, swaps on; two assignments
  for row in data["rows"]:  # the all-reduce follows the pipeline: it lengthens the iteration
    assert row["scheduler_pipeline_s"] < row["scheduler_s"] <= row["random_s"]


# -- the scheduler's guarantees and the lower bound, on seeded random cases ------------------------


def _metric_topology(rng):
  """Random nodes in random regions whose transfer times satisfy the triangle inequality for any
  message size: latency ``5 ms + 100 ms x distance`` between regions (a metric plus a constant),
  bandwidth the smaller of the two regions' (``bytes / bandwidth`` is then a max, also a metric),
  and inside a region 1 ms at 10 Gbit/s, faster than any link between regions."""
  m = int(rng.integers(5, 10))
  num_regions = int(rng.integers(1, 4))
  region = rng.integers(num_regions, size=m)
  xy = rng.uniform(0.0, 1.0, (num_regions, 2))
  dist = np.linalg.norm(xy[:, None] - xy[None, :], axis=-1)
  access = topology.GBIT * rng.uniform(0.1, 1.0, num_regions)
  same = region[:, None] == region[None, :]
  lat = np.where(same, 1e-3, (0.005 + 0.1 * dist)[region][:, region])
  bw = np.where(
    same, 10 * topology.GBIT, np.minimum(access[:, None], access[None, :])[region][:, region]
  )
  return topology.Topology("metric", rng.uniform(0.5, 1.0, m), region.astype(np.int32), lat, bw)


def _case(family, seed):
  """One seeded random case: a topology, costs (all-reduce priced or not), S, the partition, the
  microbatches and the skip ratio."""
  rng = np.random.default_rng(1000 * (family == "preset") + seed)
  s_count = int(rng.integers(3, 6))
  if family == "metric":
    topo = _metric_topology(rng)
    while topo.num_nodes < s_count:
      topo = _metric_topology(rng)
  else:
    name = topology.PRESETS[seed % 3]
    topo = topology.preset(name, s_count + int(rng.integers(1, s_count + 3)), seed=seed)
  grad = int(rng.integers(2)) * 2
  costs = simulate.transformer_costs(s_count, 12, 1024, 8000, 512, 2, 1e14, grad)
  part = assign.assign(topo, costs, s_count, seed=seed, restarts=1, sweeps=2)
  skips = [r for r in (0.0, 0.25, 0.5) if paths.path_length(s_count, r) >= 1]
  skip = skips[int(rng.integers(len(skips)))]
  return topo, costs, part, int(rng.integers(4, 9)), skip


@pytest.fixture(scope="module")
def random_cases():
  """Per seeded case: its inputs and every plan the properties compare."""
  out = []
  for family in ("metric", "preset"):
    for seed in range(20):
      topo, costs, part, n, skip = _case(family, seed)
      plans = {
        "in order": schedule.schedule(topo, costs, part, n, skip, False, seed=seed, iters=25),
        "swap": schedule.schedule(topo, costs, part, n, skip, True, seed=seed, iters=25),
        "random": baselines.random_plan(topo, costs, part, n, skip, True, seed=seed),
        "gpipe": baselines.full_pipeline(topo, costs, part, n, "gpipe"),
        "1f1b": baselines.full_pipeline(topo, costs, part, n, "1f1b"),
      }
      out.append(
        dict(
          family=family, seed=seed, topo=topo, costs=costs, part=part, n=n, skip=skip, plans=plans
        )
      )
  return out


def test_swaps_are_never_worse_than_in_order(random_cases):
  for case in random_cases:
    p = case["plans"]
    assert p["swap"].makespan <= p["in order"].makespan * (1 + 1e-12), (
      case["family"],
      case["seed"],
    )


def test_skipping_is_never_slower_than_the_full_pipeline(random_cases):
  # Under the condition of schedule.schedule's docstring: transfer times obeying the triangle
  # inequality (every metric case, and single-cluster presets) and lanes with stages left out that
  # meet the memory and balance bounds.
  checked = 0
  for case in random_cases:
    topo, costs, part, n, skip, p = (
      case[k] for k in ("topo", "costs", "part", "n", "skip", "plans")
    )
    if case["family"] == "metric":
      assert left_out.triangle_holds(topo, costs.act_bytes)
    if not (
      left_out.triangle_holds(topo, costs.act_bytes)
      and schedule.left_out_fits(topo, costs, part, n, skip)
    ):
      continue
    checked += 1
    full = min(p["gpipe"].makespan, p["1f1b"].makespan)
    for mode in ("in order", "swap"):
      assert p[mode].makespan <= full * (1 + 1e-12), (case["family"], case["seed"], mode)
  assert checked >= 20, checked


def test_every_plan_is_consistent_and_above_the_lower_bound(random_cases):
  for case in random_cases:
    topo, costs, part, n, skip, p = (
      case[k] for k in ("topo", "costs", "part", "n", "skip", "plans")
    )
    low = bounds.lower_bound(topo, costs, part, n, skip)
    full_low = bounds.lower_bound(topo, costs, part, n, 0.0)
    assert 0 < bounds.lower_bound(topo, costs, part, n, skip, balance=None) <= low
    for name, plan in p.items():
      res = simulate.replay(topo, costs, plan.routes(), plan.order, part)
      assert res.makespan == pytest.approx(plan.makespan, rel=1e-12), (case["seed"], name)
      bound = full_low if name in ("gpipe", "1f1b") else low
      assert plan.makespan >= bound, (case["family"], case["seed"], name, plan.makespan, bound)


def test_skipping_pays_for_links_the_full_pipeline_never_crosses():
  # Four nodes, one per stage. The full pipeline crosses A-B, B-C, C-D, D-A (both ways); every path
  # of 2 stages crosses a diagonal (A-C or B-D), 100 s each way here. So no skip-0.25 plan can be
  # as fast as the full pipeline: the lower bound already says so, and the triangle inequality,
  # the condition of the scheduler's guarantee, fails.
  diagonal = np.array([[0, 0, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0], [0, 1, 0, 0]], bool)
  topo = _topo(np.where(diagonal, 100.0, 0.01), np.full((4, 4), np.inf))
  costs = simulate.Costs(fwd_S=np.ones(4), head=0.0, act_bytes=0.0)
  part = ((0,), (1,), (2,), (3,))
  full = baselines.full_pipeline(topo, costs, part, 2, "gpipe").makespan
  assert full < 20.0
  assert not left_out.triangle_holds(topo, 0.0)
  assert bounds.lower_bound(topo, costs, part, 2, 0.25) > 200.0
  plan = schedule.schedule(topo, costs, part, 2, 0.25, True, iters=20)
  assert plan.makespan > 10 * full
