r"""Step-time model of data-parallel methods: compute plus alpha-beta ring communication.

Pure Python (no JAX). Given the time of one microbatch's forward and backward pass on one worker,
the parameter count and the links between workers, it predicts the wall-clock time of one optimizer
update and how much of it the workers spend idle waiting for communication, for ZeRO-1 (what
:func:`acco_jax.zero1` runs), a replicated all-reduce DDP, DPU and ACCO, and for the baseline of the
reference PyTorch code (DDP that all-reduces fp32 gradients after *every* microbatch, plus
``ZeroRedundancyOptimizer``'s per-rank broadcasts of the updated fp32 parameters).

Communication. A ring collective over :math:`n` workers of a buffer of :math:`M` bytes takes
:math:`n - 1` steps; in each step every worker sends :math:`M/n` bytes to its neighbour, so

.. math::

  T_{RS}(M) = T_{AG}(M) = (n - 1)\Big(\alpha + \frac{M}{n\,\beta}\Big), \qquad
  T_{AR}(M) = T_{RS}(M) + T_{AG}(M),

and each worker sends :math:`\frac{n-1}{n} M` bytes per reduce-scatter or all-gather. :math:`\alpha`
is the latency of one hop and :math:`\beta` the bandwidth of one ring flow. The steps run in
lockstep, so a ring over several nodes is as slow as its slowest hop: :math:`\beta = \min` and
:math:`\alpha = \max` over the links it crosses (NVLink or PCIe inside a node, the network across
nodes).

Per update, with :math:`C = k\,t_{mb}` the compute of :math:`k` microbatches per worker and
:math:`X = T_{RS} + T_{opt} + T_{AG}` the communication chain of one ZeRO-1 step:

.. math::

  T_{zero1} = C + X, \qquad T_{dpu} = \max(C, X), \qquad T_{acco} = 2 \max(C/2, X),

sequential methods add, overlapped ones take the maximum (the physical limit of perfect overlap).
ACCO communicates twice per update (estimate and commit), each time behind half of the microbatches,
so it is communication-bound once :math:`X > C/2`, and its best speed-up over ZeRO-1 is
:math:`1.5\times` (at :math:`X = C/2`) with a fixed ``k``. The reference code does not fix ``k``:
while a communication lasts, workers keep accumulating microbatches (the batch grows, the GPUs never
wait), so per microbatch its time is the compute alone (the ``adaptive`` variants).

Single loop. In one XLA program whose microbatches run in one ``while`` loop, the all-gather
consumes the optimizer update of the reduce-scatter's output, so at most one of the two can be in
flight across the loop: :math:`T_{stage} = \max(C_{stage}, T_{RS}) + T_{opt} + T_{AG}` (the
``*_single_loop`` variants), unless the loop is split in two, which ``acco_jax.dp.stage`` does for the
delayed methods (reduce-scatter behind the first half of the microbatches, all-gather behind the
second; the non-``single_loop`` variants).

Stragglers. If one microbatch's compute varies across workers with coefficient of variation
:math:`c` (e.g. sequences padded to the longest in their batch), a synchronisation after :math:`m`
microbatches waits for the slowest of :math:`n` workers, about
:math:`m\,t_{mb}(1 + c\,e_n/\sqrt{m})` with :math:`e_n = \mathbb{E}\max` of :math:`n` standard
normals.

References:
  Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009.
  Nabli et al., "ACCO: Accumulate While You Communicate for Communication-Overlapped Sharded LLM
  Training", arXiv:2406.02613 (Table 3 and the reference code's DDP baseline).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

GBIT = 1e9 / 8  # bytes/s in one Gbit/s
GBYTE = 1e9

METHODS = (
  "ddp",
  "zero1",
  "dpu",
  "acco",
  "dpu_single_loop",
  "acco_single_loop",
  "dpu_adaptive",
  "acco_adaptive",
  "ddp_per_microbatch",
)


@dataclasses.dataclass(frozen=True)
class Link:
  """A class of link: ``bandwidth`` (bytes/s one ring flow gets, one way), ``latency`` (s/hop)."""

  bandwidth: float
  latency: float = 0.0

  def __post_init__(self):
    if self.bandwidth <= 0 or self.latency < 0:
      raise ValueError(f"need bandwidth > 0 and latency >= 0, got {self}")


@dataclasses.dataclass(frozen=True)
class Cluster:
  """``nodes`` x ``per_node`` workers; ``intra`` links inside a node, ``inter`` across nodes.

  A ring over all workers visits each node's workers consecutively, so one flow per direction
  crosses each node boundary: ``inter.bandwidth`` is what that flow gets (a node's network
  bandwidth).
  """

  nodes: int
  per_node: int
  intra: Link
  inter: Link | None = None

  def __post_init__(self):
    if self.nodes < 1 or self.per_node < 1:
      raise ValueError(f"need nodes >= 1 and per_node >= 1, got {self.nodes}, {self.per_node}")
    if self.nodes > 1 and self.inter is None:
      raise ValueError("a multi-node cluster needs an inter-node link")

  @property
  def workers(self) -> int:
    return self.nodes * self.per_node

  def ring_link(self) -> Link:
    """The link that paces a ring over all workers: the slowest bandwidth, the largest latency."""
    links = [self.intra] if self.per_node > 1 else []
    if self.nodes > 1:
      links.append(self.inter)
    if not links:
      return Link(math.inf, 0.0)
    return Link(min(x.bandwidth for x in links), max(x.latency for x in links))


def ring_bytes(kind: str, n: int, nbytes: float) -> float:
  r"""Bytes one worker sends in a ring collective over ``n`` workers of an ``nbytes`` buffer.

  ``'reduce_scatter'`` and ``'all_gather'``: :math:`\frac{n-1}{n} M`; ``'all_reduce'``: twice that;
  ``'broadcasts'`` (each worker broadcasts its :math:`M/n` shard, as ``ZeroRedundancyOptimizer``
  does): on average :math:`\frac{n-1}{n} M` as well. ``nbytes`` is the full buffer (the
  reduce-scatter's input, the all-gather's output).
  """
  if kind not in ("reduce_scatter", "all_gather", "all_reduce", "broadcasts"):
    raise ValueError(f"unknown collective {kind!r}")
  if n <= 1:
    return 0.0
  one = (n - 1) / n * nbytes
  return 2 * one if kind == "all_reduce" else one


def collective_time(kind: str, cluster: Cluster, nbytes: float) -> float:
  r"""Seconds for a ring collective of an ``nbytes`` buffer over all workers of ``cluster``.

  :math:`(n-1)(\alpha + M/(n\beta))` for a reduce-scatter or all-gather, twice for an all-reduce.
  ``'broadcasts'``: :math:`n` pipelined ring broadcasts of :math:`M/n` bytes, each
  :math:`(n-1)\alpha + M/(n\beta)`.
  """
  n = cluster.workers
  ring_bytes(kind, n, nbytes)  # validates kind
  if n <= 1:
    return 0.0
  link = cluster.ring_link()
  one = (n - 1) * (link.latency + nbytes / (n * link.bandwidth))
  if kind == "all_reduce":
    return 2 * one
  if kind == "broadcasts":
    return n * ((n - 1) * link.latency + nbytes / (n * link.bandwidth))
  return one


def expected_max_normal(n: int) -> float:
  r""":math:`e_n = \mathbb{E}[\max_{i \le n} Z_i]` for i.i.d. standard normals (numerical integral).

  :math:`e_1 = 0`, :math:`e_2 = 1/\sqrt\pi`, :math:`e_8 \approx 1.4236`.
  """
  if n <= 1:
    return 0.0
  x = np.linspace(-10.0, 10.0, 20001)
  pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
  cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
  f = x * n * pdf * cdf ** (n - 1)
  return float(np.sum((f[1:] + f[:-1]) * 0.5 * np.diff(x)))


def straggler_factor(n: int, cv: float, m: float = 1) -> float:
  r"""The slowest of ``n`` workers over ``m`` microbatches, relative to the mean.

  :math:`1 + c\,e_n/\sqrt m` for a per-microbatch coefficient of variation :math:`c`.
  """
  if cv < 0 or m <= 0:
    raise ValueError(f"need cv >= 0 and m > 0, got {cv}, {m}")
  return 1.0 + cv * expected_max_normal(n) / math.sqrt(m)


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one worker computes and communicates per optimizer update.

  Attributes:
    params: number of values in the flat gradient / parameter buffer (Ψ, padded).
    microbatch_time: seconds of one microbatch's forward + backward on one worker.
    microbatches: ``k`` per worker per update (ACCO runs ``k/2`` in each of its two stages).
    comm_bytes: bytes per value of the reduce-scatter and all-gather (2 for bf16).
    opt_time: seconds of the sharded optimizer step on one worker's 1/N shard (DDP runs N times as
      much: its optimizer is replicated).
    backward_fraction: share of ``microbatch_time`` spent in the backward pass (``2/3``).
    cv: coefficient of variation of one microbatch's compute across workers (stragglers).
    grad_bytes: bytes per gradient value all-reduced by the per-microbatch DDP (4: fp32).
    param_bytes: bytes per parameter broadcast by ``ZeroRedundancyOptimizer`` (4: fp32 params).
    bwd_overlap: share of the backward pass that hides the per-microbatch DDP's bucketed all-reduce
      (0: none, 1: all of it).
  """

  params: float
  microbatch_time: float
  microbatches: int
  comm_bytes: int = 2
  opt_time: float = 0.0
  backward_fraction: float = 2 / 3
  cv: float = 0.0
  grad_bytes: int = 4
  param_bytes: int = 4
  bwd_overlap: float = 0.0

  def __post_init__(self):
    if self.microbatches < 1 or self.microbatch_time < 0 or self.params < 0:
      raise ValueError(f"invalid workload {self}")
    if not 0.0 <= self.bwd_overlap <= 1.0:
      raise ValueError(f"bwd_overlap must be in [0, 1], got {self.bwd_overlap}")


class StepTime(NamedTuple):
  """Predicted cost of one optimizer update on one worker.

  Attributes:
    method: the method's name.
    time: wall-clock seconds per update (for ``*_adaptive``: per ``k`` microbatches' worth of work).
    compute: seconds of useful compute (``k`` mean microbatch times).
    comm: seconds the communication takes (hidden or not).
    exposed: seconds of communication not hidden behind compute.
    idle_fraction: ``1 - compute / time``: time not spent computing (exposed comm and stragglers).
    bytes_sent: bytes one worker sends per update.
    batch_growth: microbatches actually run per ``k`` planned (adaptive ACCO/DPU accumulate more
      while a communication outlasts the compute; 1 otherwise).
  """

  method: str
  time: float
  compute: float
  comm: float
  exposed: float
  idle_fraction: float
  bytes_sent: float
  batch_growth: float = 1.0


def step_time(method: str, work: Workload, cluster: Cluster) -> StepTime:
  r"""Time of one update of ``method`` (one of :data:`METHODS`) for ``work`` on ``cluster``.

  * ``zero1``: :math:`C s_k + T_{RS} + T_{opt} + T_{AG}` (one reduction per update, sequential).
  * ``ddp``: :math:`C s_k + T_{AR} + n T_{opt}` (all-reduce, replicated optimizer).
  * ``dpu``: :math:`\max(C s_k, X)`; ``acco``: :math:`2\max(C s_{k/2}/2, X)` with
    :math:`X = T_{RS} + T_{opt} + T_{AG}` (fixed ``k``, as :func:`acco_jax.make_train_step`).
  * ``dpu_single_loop`` / ``acco_single_loop``: per stage :math:`\max(C_{stage} s, T_{RS}) + T_{opt}
    + T_{AG}` (one collective hidden behind a single loop, the other exposed).
  * ``dpu_adaptive`` / ``acco_adaptive`` (reference code): compute never waits, :math:`C` per ``k``
    microbatches; ``batch_growth`` :math:`= \lceil X / C_{stage} \rceil`.
  * ``ddp_per_microbatch`` (reference code's baseline): :math:`k\,(t_{mb} s_1 + \max(0,
    T_{AR}^{fp32} - h\,b\,t_{mb})) + T_{opt} + T_{bcast}^{fp32}`, with :math:`h` = ``bwd_overlap``
    and :math:`b` = ``backward_fraction``.

  :math:`s_m` = :func:`straggler_factor` for a synchronisation every :math:`m` microbatches.
  """
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
  n, k, t = cluster.workers, work.microbatches, work.microbatch_time
  flat = work.params * work.comm_bytes
  t_rs = collective_time("reduce_scatter", cluster, flat)
  t_ag = collective_time("all_gather", cluster, flat)
  chain = t_rs + work.opt_time + t_ag
  pair_bytes = ring_bytes("reduce_scatter", n, flat) + ring_bytes("all_gather", n, flat)
  compute = k * t
  s = lambda m: straggler_factor(n, work.cv, m) if work.cv else 1.0
  growth = 1.0
  if method == "zero1":
    span, comm, total, sent = compute * s(k), chain, compute * s(k) + chain, pair_bytes
  elif method == "ddp":
    comm = collective_time("all_reduce", cluster, flat) + n * work.opt_time
    span, sent = compute * s(k), ring_bytes("all_reduce", n, flat)
    total = span + comm
  elif method == "dpu":
    span, comm, sent = compute * s(k), chain, pair_bytes
    total = max(span, chain)
  elif method == "acco":
    span, comm, sent = compute * s(k / 2), 2 * chain, 2 * pair_bytes
    total = 2 * max(span / 2, chain)
  elif method in ("dpu_single_loop", "acco_single_loop"):
    stages = 2 if method == "acco_single_loop" else 1
    span = compute * s(k / stages)
    comm, sent = stages * chain, stages * pair_bytes
    total = stages * (max(span / stages, t_rs) + work.opt_time + t_ag)
  elif method in ("dpu_adaptive", "acco_adaptive"):
    stages = 2 if method == "acco_adaptive" else 1
    stage_compute = compute / stages
    growth = max(1.0, math.ceil(chain / stage_compute - 1e-12)) if stage_compute > 0 else 1.0
    span = total = compute
    comm, sent = stages * chain, stages * pair_bytes
  else:  # ddp_per_microbatch
    grads = work.params * work.grad_bytes
    t_ar = collective_time("all_reduce", cluster, grads)
    hidden = work.bwd_overlap * work.backward_fraction * t
    t_bc = collective_time("broadcasts", cluster, work.params * work.param_bytes)
    span = k * t * s(1)
    comm = k * t_ar + t_bc
    total = span + k * max(0.0, t_ar - hidden) + work.opt_time + t_bc
    sent = k * ring_bytes("all_reduce", n, grads) + ring_bytes(
      "broadcasts", n, work.params * work.param_bytes
    )
  exposed = max(0.0, total - span)
  idle = 1.0 - compute / total if total > 0 else 0.0
  return StepTime(method, total, compute, comm, exposed, idle, sent, growth)


def time_reduction(baseline: StepTime, method: StepTime) -> float:
  """``1 - T_method / T_baseline`` (the paper's Table 3 "reduction"; same work per update)."""
  return 1.0 - method.time / baseline.time


def speedup(baseline: StepTime, method: StepTime) -> float:
  """``T_baseline / T_method``."""
  return baseline.time / method.time


def transformer_flops_per_token(
  layers: int, width: int, vocab: int, seq_len: int, mlp: int | None = None
) -> float:
  r"""Training FLOPs per token of a GPT decoder (forward + backward = 3 x forward).

  :math:`6\,(L_{layers}(4D^2 + 2DF) + VD) + 12\,L_{layers} D\,T` with :math:`F = 4D` by default: the
  weight matmuls (tied head included) and the attention scores over the full :math:`T \times T`
  square (as :func:`acco_jax.model.flops_per_token`).
  """
  mlp = 4 * width if mlp is None else mlp
  weights = layers * (4 * width**2 + 2 * width * mlp) + vocab * width
  return float(6 * weights + 12 * layers * width * seq_len)


def microbatch_time(flops_per_token: float, tokens: float, peak_flops: float, mfu: float) -> float:
  """Seconds of one microbatch of ``tokens`` tokens at model-FLOPs utilisation ``mfu``."""
  if not 0.0 < mfu <= 1.0:
    raise ValueError(f"mfu must be in (0, 1], got {mfu}")
  return flops_per_token * tokens / (peak_flops * mfu)
