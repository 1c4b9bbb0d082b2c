"""The step-time model against hand-computed numbers (the arithmetic is redone in the tests)."""

import dataclasses
import math

import pytest

from acco_jax.analysis import perfmodel as pm
from acco_jax.analysis import perfmodel_quantized as pmq

# 4 workers on one node, 1 GB/s links, 1 ms per hop; 1e6 values in bf16 = 2e6 bytes.
ONE_NODE = pm.Cluster(nodes=1, per_node=4, intra=pm.Link(1e9, 1e-3))
WORK = pm.Workload(params=1e6, microbatch_time=0.01, microbatches=4, comm_bytes=2)
# one ring step: 1 ms + (2e6 / 4) B / 1e9 B/s = 1.5 ms; 3 steps = 4.5 ms per RS or AG.
T_RS = 3 * (1e-3 + 0.5e6 / 1e9)


def test_ring_bytes_formula():
  assert pm.ring_bytes("reduce_scatter", 8, 800) == 700  # (8-1)/8 * 800
  assert pm.ring_bytes("all_gather", 8, 800) == 700
  assert pm.ring_bytes("all_reduce", 8, 800) == 1400
  assert pm.ring_bytes("broadcasts", 4, 400) == 300
  assert pm.ring_bytes("all_reduce", 1, 800) == 0
  with pytest.raises(ValueError):
    pm.ring_bytes("gossip", 4, 1)


def test_collective_time_alpha_beta():
  assert pm.collective_time("reduce_scatter", ONE_NODE, 2e6) == pytest.approx(T_RS)
  assert pm.collective_time("all_gather", ONE_NODE, 2e6) == pytest.approx(T_RS)
  assert pm.collective_time("all_reduce", ONE_NODE, 2e6) == pytest.approx(2 * T_RS)
  # 4 broadcasts of 0.5 MB, each 3 hops of latency + 0.5e6/1e9 s of transfer
  assert pm.collective_time("broadcasts", ONE_NODE, 2e6) == pytest.approx(4 * (3e-3 + 0.5e-3))
  single = pm.Cluster(1, 1, pm.Link(1e9, 1e-3))
  assert pm.collective_time("all_reduce", single, 2e6) == 0.0


def test_ring_is_paced_by_slowest_link():
  nvlink, net = pm.Link(300e9, 5e-6), pm.Link(12.5e9, 10e-6)
  two_nodes = pm.Cluster(nodes=2, per_node=4, intra=nvlink, inter=net)
  assert two_nodes.workers == 8
  assert two_nodes.ring_link() == pm.Link(12.5e9, 10e-6)
  # 8 workers, 7 steps of (10 us + 1e9 B / 8 / 12.5e9 B/s)
  expected = 7 * (10e-6 + 1e9 / 8 / 12.5e9)
  assert pm.collective_time("all_gather", two_nodes, 1e9) == pytest.approx(expected)
  one_node = pm.Cluster(nodes=1, per_node=8, intra=nvlink)
  assert one_node.ring_link() == nvlink
  # one worker per node: only the network is crossed
  assert pm.Cluster(nodes=4, per_node=1, intra=nvlink, inter=net).ring_link() == net
  with pytest.raises(ValueError):
    pm.Cluster(nodes=2, per_node=4, intra=nvlink)


def test_sequential_is_sum_overlapped_is_max():
  compute = 4 * 0.01
  chain = 2 * T_RS  # RS + AG, no optimizer time
  zero1 = pm.step_time("zero1", WORK, ONE_NODE)
  assert zero1.time == pytest.approx(compute + chain)
  assert zero1.exposed == pytest.approx(chain)
  assert zero1.idle_fraction == pytest.approx(chain / (compute + chain))
  dpu = pm.step_time("dpu", WORK, ONE_NODE)
  assert dpu.time == pytest.approx(max(compute, chain)) and dpu.exposed == 0
  acco = pm.step_time("acco", WORK, ONE_NODE)
  assert acco.time == pytest.approx(2 * max(compute / 2, chain))
  ddp = pm.step_time("ddp", WORK, ONE_NODE)
  assert ddp.time == pytest.approx(compute + 2 * T_RS)


def test_acco_becomes_communication_bound_at_half_the_compute():
  # chain = 9 ms; two stages of 9 ms > 2 x 10 ms of compute per stage? k=2: 10 ms per stage.
  work = pm.Workload(params=1e6, microbatch_time=0.005, microbatches=2)  # 5 ms / stage of compute
  acco = pm.step_time("acco", work, ONE_NODE)
  chain = 2 * T_RS  # 9 ms > 5 ms
  assert acco.time == pytest.approx(2 * chain)
  assert acco.exposed == pytest.approx(2 * chain - 0.01)
  assert acco.bytes_sent == pytest.approx(2 * 2 * 0.75 * 2e6)  # two RS+AG pairs per update
  zero1 = pm.step_time("zero1", work, ONE_NODE)
  assert zero1.bytes_sent == pytest.approx(2 * 0.75 * 2e6)
  assert acco.bytes_sent == pytest.approx(2 * zero1.bytes_sent)


def test_acco_speedup_between_one_half_and_one_and_a_half():
  """(C + X) / (2 max(C/2, X)): 1.5 at X = C/2, 1 at X = C, towards 0.5 when X >> C."""
  chain = 2 * T_RS  # 9 ms
  for t in (1e-5, 1e-4, 1e-3, 2.25e-3, 5e-3, 1e-2, 1e-1):
    work = pm.Workload(params=1e6, microbatch_time=t, microbatches=8)
    s = pm.speedup(pm.step_time("zero1", work, ONE_NODE), pm.step_time("acco", work, ONE_NODE))
    c = 8 * t
    assert s == pytest.approx((c + chain) / (2 * max(c / 2, chain)))
    assert 0.5 < s <= 1.5 + 1e-9
    assert (s >= 1.0) == (chain <= c)  # ACCO loses to ZeRO-1 once one chain outlasts all compute
  best = pm.Workload(params=1e6, microbatch_time=2 * 2 * T_RS / 8, microbatches=8)
  s = pm.speedup(pm.step_time("zero1", best, ONE_NODE), pm.step_time("acco", best, ONE_NODE))
  assert s == pytest.approx(1.5)


def test_adaptive_never_idles_and_grows_the_batch():
  work = pm.Workload(params=1e6, microbatch_time=0.001, microbatches=2)  # 1 ms / stage, chain 9 ms
  a = pm.step_time("acco_adaptive", work, ONE_NODE)
  assert a.time == pytest.approx(0.002) and a.idle_fraction == 0 and a.exposed == 0
  assert a.batch_growth == 9  # ceil(9 ms / 1 ms)
  d = pm.step_time("dpu_adaptive", work, ONE_NODE)
  assert d.batch_growth == 5  # ceil(9 ms / 2 ms)


def test_per_microbatch_ddp_baseline():
  work = pm.Workload(params=1e6, microbatch_time=0.01, microbatches=4, opt_time=1e-3)
  t_ar = 2 * 3 * (1e-3 + 1e6 * 4 / 4 / 1e9)  # fp32 gradients: 4e6 bytes
  t_bc = 4 * (3e-3 + 1e6 * 4 / 4 / 1e9)  # fp32 params, 4 broadcasts of 1 MB
  base = pm.step_time("ddp_per_microbatch", work, ONE_NODE)
  assert base.time == pytest.approx(4 * (0.01 + t_ar) + 1e-3 + t_bc)
  assert base.bytes_sent == pytest.approx(4 * 2 * 0.75 * 4e6 + 0.75 * 4e6)
  # the backward (2/3 of 10 ms) hides min(t_ar, 6.67 ms) of each all-reduce
  hidden = dataclasses.replace(work, bwd_overlap=1.0)
  t = pm.step_time("ddp_per_microbatch", hidden, ONE_NODE).time
  assert t == pytest.approx(4 * (0.01 + max(0.0, t_ar - 0.01 * 2 / 3)) + 1e-3 + t_bc)


def test_monotone_in_bandwidth_and_workers():
  prev = None
  for gbps in (1, 10, 100, 1000):
    c = pm.Cluster(4, 8, pm.Link(300e9, 5e-6), pm.Link(gbps * pm.GBIT, 10e-6))
    times = {m: pm.step_time(m, WORK, c).time for m in ("zero1", "acco", "dpu", "ddp")}
    if prev:
      assert all(times[m] <= prev[m] + 1e-15 for m in times)
    prev = times
  # ring bytes per worker grow with n towards 2x the buffer (RS + AG)
  sent = [pm.step_time("zero1", WORK, pm.Cluster(1, n, pm.Link(1e9))).bytes_sent for n in (2, 4, 8)]
  assert sent == pytest.approx([2e6, 3e6, 3.5e6])


def test_stragglers():
  assert pm.expected_max_normal(1) == 0.0
  assert pm.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
  assert pm.expected_max_normal(8) == pytest.approx(1.4236, abs=1e-4)
  assert pm.straggler_factor(8, 0.2, 4) == pytest.approx(1 + 0.2 * 1.4236 / 2, abs=1e-4)
  work = pm.Workload(params=1e6, microbatch_time=0.01, microbatches=4, cv=0.2)
  c8 = pm.Cluster(1, 8, pm.Link(1e12))
  z = pm.step_time("zero1", work, c8)
  assert z.compute == pytest.approx(0.04)  # useful compute is the mean
  assert z.idle_fraction > 0.1  # waiting for the slowest of 8
  assert pm.step_time("acco_adaptive", work, c8).idle_fraction == 0


def test_flops_and_microbatch_time():
  # GPT-2 small: 12 x (4 * 768^2 + 8 * 768^2) + 50257 * 768 weights in matmuls
  weights = 12 * 12 * 768**2 + 50257 * 768
  expected = 6 * weights + 12 * 12 * 768 * 1024
  assert pm.transformer_flops_per_token(12, 768, 50257, 1024) == expected
  assert pm.microbatch_time(1e9, 1000, 1e12, 0.5) == pytest.approx(2.0)  # 1e12 FLOP at 5e11/s
  with pytest.raises(ValueError):
    pm.microbatch_time(1e9, 1000, 1e12, 0.0)


def test_time_reduction_matches_table3_definition():
  base = pm.StepTime("zero1", 226.0, 0, 0, 0, 0, 0)  # 3h46m in minutes
  acco = pm.StepTime("acco", 29.0, 0, 0, 0, 0, 0)
  assert pm.time_reduction(base, acco) == pytest.approx(1 - 29 / 226)
  assert round(100 * pm.time_reduction(base, acco)) == 87


def test_single_loop_hides_only_one_collective():
  # one while loop per stage: max(C_stage, T_RS) + T_opt + T_AG, twice per ACCO update
  a = pm.step_time("acco_single_loop", WORK, ONE_NODE)
  assert a.time == pytest.approx(2 * (max(0.02, T_RS) + T_RS))
  assert a.exposed == pytest.approx(2 * T_RS)
  d = pm.step_time("dpu_single_loop", WORK, ONE_NODE)
  assert d.time == pytest.approx(max(0.04, T_RS) + T_RS)
  slow = pm.Workload(params=1e6, microbatch_time=0.001, microbatches=2)  # 1 ms of compute / stage
  a = pm.step_time("acco_single_loop", slow, ONE_NODE)
  assert a.time == pytest.approx(2 * (T_RS + T_RS))  # communication-bound: nothing left to hide
  assert (
    pm.step_time("acco", WORK, ONE_NODE).time
    <= pm.step_time("acco_single_loop", WORK, ONE_NODE).time
  )


# -- quantized communication --------------------------------------------------------------------

# 4 nodes x 8 workers, no latency, NVLink 100x the network: the network's bytes decide.
FOUR_BY_EIGHT = pm.Cluster(4, 8, intra=pm.Link(1e12), inter=pm.Link(1e10))


def test_wire_bytes_per_value():
  assert pmq.wire_bytes_per_value("int8", 256) == 1 + 4 / 256
  assert pmq.wire_bytes_per_value("int4", 2048) == 0.5 + 4 / 2048
  with pytest.raises(ValueError):
    pmq.wire_bytes_per_value("int2")


def test_quantized_reduce_two_level_and_flat_volumes():
  """Two levels: each node's link carries (A-1)/A P b_q of node sums; flat: every device sends its
  own chunks for the other nodes, 8 x 24/32 P b_q per node's link."""
  p, b = 1e8, 1.0
  t_node, t_a2a, _ = pmq.quantized_reduce_time(FOUR_BY_EIGHT, p, b, node_size=8)
  assert t_a2a == pytest.approx(3 / 4 * p * b / 1e10)
  assert t_node == pytest.approx(7 * (p * 2 / 8) / 1e12)  # bf16 ring over the node's 8 devices
  _, flat, _ = pmq.quantized_reduce_time(FOUR_BY_EIGHT, p, b, node_size=1)
  assert flat == pytest.approx(8 * 24 / 32 * p * b / 1e10)
  with pytest.raises(ValueError, match="node_size must be 1 or the cluster's 8"):
    pmq.quantized_reduce_time(FOUR_BY_EIGHT, p, b, node_size=4)


def test_quantized_acco_moves_the_compute_bound_bandwidth():
  """ACCO hides its chain X behind half an update's compute. bf16: X = 2 (31/32) 2P / β; int8 in
  two levels: X = (3/4 + 31/32) (1 + 4/256) P / β, 2.22x less, so ACCO stays compute-bound down
  to a 2.22x lower bandwidth; in the compute-bound regime it costs 2 (T_node + t_q) more."""
  work = pm.Workload(params=1e8, microbatch_time=0.0125, microbatches=4, comm_bytes=2)
  bf16 = pm.step_time("dpu", work, FOUR_BY_EIGHT).comm
  wire = pmq.wire_bytes_per_value("int8", 256)
  _, a2a, _ = pmq.quantized_reduce_time(FOUR_BY_EIGHT, 1e8, wire, 8)
  chain = a2a + pm.collective_time("all_gather", FOUR_BY_EIGHT, 1e8 * wire)
  assert bf16 / chain == pytest.approx((2 * 31 / 32 * 2) / ((3 / 4 + 31 / 32) * wire))
  assert bf16 / chain > 2.2
  t = pmq.quantized_step_time("acco", work, FOUR_BY_EIGHT, "int8", quant_time=1e-3)
  t_node = pmq.quantized_reduce_time(FOUR_BY_EIGHT, 1e8, wire, 8)[0]
  assert chain < 0.025 < bf16  # C/2 = 0.025 s: int8 hides its chain, bf16 does not
  assert t.time == pytest.approx(2 * (t_node + 1e-3 + 0.025))
  assert pm.step_time("acco", work, FOUR_BY_EIGHT).time == pytest.approx(2 * bf16)
  with pytest.raises(ValueError, match="zero1 and acco"):
    pmq.quantized_step_time("dpu", work, FOUR_BY_EIGHT)
