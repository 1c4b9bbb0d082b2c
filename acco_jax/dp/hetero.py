r"""Heterogeneous workers: per-worker microbatch budgets, fixed or adapted to measured speeds.

ACCO's update is the mean over *all* microbatches of *all* workers (``acco_jax.dp.stage`` divides the
summed gradients by the summed counts), so workers need not accumulate the same number of
microbatches: a fast worker can keep accumulating while a slow one finishes. Here worker ``i``'s
*budget* :math:`b_i` is how many microbatches it accumulates in a stage (``1 <= b_i <= k_max``, the
static block size the compiled step is built for).

Given each worker's measured time per microbatch :math:`t_i` and the time :math:`t_c` of one
stage's communication, a stage lasts about :math:`\max(\max_i b_i t_i,\ t_c)`. Two policies:

* ``balance``: keep the global number of microbatches per stage fixed at :math:`\sum_i b_i = B`
  (so the optimization per token is the homogeneous run's) and split it to minimise the slowest
  finish :math:`\max_i b_i t_i` (greedy: each next microbatch goes to the worker that would finish
  it first, which is optimal for this objective).
* ``fill``: as the paper's reference code, every worker accumulates until the stage window closes,
  :math:`b_i = \lfloor W / t_i \rfloor` with :math:`W = \max(t_c,\ b_0 \max_j t_j)`: the slowest
  worker does the base budget :math:`b_0` and no one waits; the batch grows with the spare speed.

:class:`BudgetPolicy` smooths the timings (exponential moving average) and adopts a new plan only
when it moves more than a ``hysteresis`` share of the microbatches, so noise does not make budgets
(and the effective batch) flicker. :func:`slowed` makes chosen workers slower by a host-callback
sleep after each microbatch's forward pass, to study stragglers on homogeneous hardware.

References:
  Nabli et al., "ACCO: Accumulate While You Communicate for Communication-Overlapped Sharded LLM
  Training", arXiv:2406.02613 (Section 4.5 and the heterogeneous-workers experiment).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax import errors

POLICIES = ("balance", "fill")


def parse_budgets(spec: str, num_workers: int) -> np.ndarray:
  """``"4,4,4,1"`` -> int array of per-worker budgets (one entry per device on the data axis)."""
  try:
    budgets = np.array([int(x) for x in spec.split(",")], np.int32)
  except ValueError:
    raise errors.UserValueError(
      f"hetero.budgets={spec!r}: give one integer per device, comma-separated, e.g. '4,4,4,1'"
    ) from None
  if budgets.shape != (num_workers,) or budgets.min() < 1:
    raise errors.UserValueError(
      f"hetero.budgets={spec!r}: need {num_workers} integers >= 1 (one per device), "
      f"got {len(budgets)}"
    )
  return budgets


def parse_slowdown(spec: str, num_workers: int) -> np.ndarray:
  """``"3:0.02,5:0.01"`` -> per-worker seconds of sleep added after each microbatch."""
  delays = np.zeros(num_workers)
  for item in filter(None, spec.split(",")):
    try:
      worker, seconds = item.split(":")
      worker, seconds = int(worker), float(seconds)
    except ValueError:
      raise errors.UserValueError(
        f"hetero.slowdown={spec!r}: use 'device:seconds,...', e.g. '3:0.02'"
      ) from None
    if not 0 <= worker < num_workers or seconds < 0:
      raise errors.UserValueError(
        f"hetero.slowdown={spec!r}: device {worker} must be in [0, {num_workers}) and seconds >= 0"
      )
    delays[worker] = seconds
  return delays


def plan_budgets(
  mb_time_s, comm_time_s: float, *, base: int, k_max: int, policy: str = "balance", k_min: int = 1
) -> np.ndarray:
  """Per-worker budgets for measured microbatch times (see the module docstring).

  Args:
    mb_time_s: ``[n]`` seconds per microbatch of each worker.
    comm_time_s: seconds of one stage's communication (``fill`` fills at least this window).
    base: the homogeneous budget: ``balance`` keeps ``n * base`` microbatches per stage; ``fill``
      gives the slowest worker ``base``.
    k_max: the largest budget (the step's static block of microbatches).
    policy: ``'balance'`` or ``'fill'``.
    k_min: the smallest budget.

  Returns:
    ``[n]`` int32 budgets in ``[k_min, k_max]``.
  """
  t = np.asarray(mb_time_s, np.float64)
  if t.ndim != 1 or not np.all(np.isfinite(t)) or t.min() <= 0:
    raise ValueError(f"microbatch times must be positive and finite, got {t}")
  if not 1 <= k_min <= base <= k_max:
    raise ValueError(f"need 1 <= k_min ({k_min}) <= base ({base}) <= k_max ({k_max})")
  n = len(t)
  if policy == "fill":
    window = max(comm_time_s, base * t.max())
    return np.clip(np.floor(window / t * (1 + 1e-9)), k_min, k_max).astype(np.int32)
  if policy != "balance":
    raise errors.UserValueError(
      f"hetero.adaptive={policy!r}: choose one of {', '.join(POLICIES)} (or '')"
    )
  budgets = np.full(n, k_min, np.int64)
  heap = [((k_min + 1) * t[i], i) for i in range(n) if k_min < k_max]
  heapq.heapify(heap)
  for _ in range(n * base - budgets.sum()):
    finish, i = heapq.heappop(heap)
    budgets[i] += 1
    if budgets[i] < k_max:
      heapq.heappush(heap, (finish + t[i], i))
  return budgets.astype(np.int32)


def makespan(budgets, mb_time_s) -> float:
  """Compute time of a stage: the slowest worker's ``b_i t_i``."""
  return float(np.max(np.asarray(budgets) * np.asarray(mb_time_s)))


class BudgetPolicy:
  r"""Budgets that follow measured speeds, smoothed and with hysteresis.

  Args:
    num_workers: devices on the data axis.
    base: the homogeneous budget per stage.
    k_max: the largest budget (the step's ``num_microbatches``).
    policy: ``'balance'`` or ``'fill'`` (:func:`plan_budgets`).
    hysteresis: adopt a new plan only when it moves more than this share of the microbatches,
      :math:`\sum_i |b'_i - b_i| > h \sum_i b_i`.
    smoothing: weight of the old timings in the moving average (0 = use the last measurement).
  """

  def __init__(
    self,
    num_workers: int,
    *,
    base: int,
    k_max: int,
    policy: str = "balance",
    hysteresis: float = 0.1,
    smoothing: float = 0.5,
  ):
    if policy not in POLICIES:
      raise errors.UserValueError(
        f"hetero.adaptive={policy!r}: choose one of {', '.join(POLICIES)} (or '')"
      )
    self.base, self.k_max, self.policy = base, k_max, policy
    self.hysteresis, self.smoothing = hysteresis, smoothing
    self.budgets = np.full(num_workers, base, np.int32)
    self.mb_time_s: np.ndarray | None = None
    self.comm_time_s = 0.0

  def observe(self, mb_time_s, comm_time_s: float) -> bool:
    """Feeds one measurement; returns whether :attr:`budgets` changed."""
    t = np.asarray(mb_time_s, np.float64)
    if self.mb_time_s is None:
      self.mb_time_s, self.comm_time_s = t, float(comm_time_s)
    else:
      a = self.smoothing
      self.mb_time_s = a * self.mb_time_s + (1 - a) * t
      self.comm_time_s = a * self.comm_time_s + (1 - a) * float(comm_time_s)
    new = plan_budgets(
      self.mb_time_s, self.comm_time_s, base=self.base, k_max=self.k_max, policy=self.policy
    )
    moved = np.abs(new - self.budgets).sum()
    if moved > self.hysteresis * self.budgets.sum():
      self.budgets = new
      return True
    return False


def slowed(loss_fn: Callable, delays_s, axis_name: str) -> Callable:
  """``loss_fn`` that sleeps ``delays_s[i]`` seconds on worker ``i`` after each forward pass.

  For straggler experiments on homogeneous hardware. Call it inside the step's ``shard_map`` (the
  worker is ``lax.axis_index(axis_name)``). The sleep is a host callback whose result (a 1.0)
  multiplies the loss, so the backward pass depends on it and cannot start before it ends; the
  gradient is unchanged. A sleeping worker leaves its CPU to the others, unlike extra compute.
  """
  delays = np.asarray(delays_s, np.float64)

  def sleep(worker, loss):
    del loss  # an operand only to order the callback after the forward pass
    time.sleep(float(delays[int(worker)]))
    return np.ones((), np.float32)

  def slow_loss(params, batch):
    out = loss_fn(params, batch)
    loss, aux = out if isinstance(out, tuple) else (out, None)
    worker = jax.lax.axis_index(axis_name)
    spec = jax.ShapeDtypeStruct((), jnp.float32)
    one = jax.pure_callback(sleep, spec, worker, jax.lax.stop_gradient(loss))
    loss = loss * jax.lax.stop_gradient(one).astype(loss.dtype)
    return (loss, aux) if isinstance(out, tuple) else loss

  return slow_loss
