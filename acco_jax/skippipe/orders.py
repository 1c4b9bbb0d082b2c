"""Training with SkipPipe paths on data-parallel workers: a layer order per microbatch.

As SkipPipe's convergence runs do, every data-parallel worker holds the whole model and runs each
microbatch through stage 0's blocks and then the blocks of the microbatch's path, in path order
(:func:`acco_jax.skippipe.paths.layer_order`). The data-parallel step itself is unchanged: the
order rides in the batch as one more array, ``batch['order']`` of shape ``[rows, K]`` (every row of
a microbatch carries its microbatch's order), and the per-microbatch loss reads it,

  loss(params, mb) = layers.loss_fn_ordered(params, cfg, mb, mb['order'][0])

so ddp, zero1 and acco all-reduce the gradients of every microbatch as usual; a block a microbatch
skipped gets nothing from it. One compiled program serves every path of one length K (a scan over
the order, :mod:`acco_jax.layers`).

A stage call takes ``n = devices x k`` microbatches; microbatch ``g = device * k + j`` covers the
batch rows ``[g B, (g + 1) B)``. Its path comes from

  'scheduled'  the path scheduler's plan for n microbatches on the configured topology
               (:func:`acco_jax.skippipe.plans.make`), the same plan every iteration;
  'random'     uniformly random paths of the skip ratio (:func:`paths.random_paths`), drawn anew
               each iteration from ``(seed, batch index)``, so a resumed run draws the same paths.
"""

from __future__ import annotations

import numpy as np

from acco_jax import errors, layers, model
from acco_jax.skippipe import paths, plans

MODES = ("scheduled", "random")


def ordered_loss(cfg: model.ModelConfig):
  """The per-microbatch loss that runs ``mb['order'][0]`` (see the module docstring)."""
  return lambda params, mb: layers.loss_fn_ordered(params, cfg, mb, mb["order"][0])


class LayerOrders:
  """The layer order of every microbatch of every iteration.

  Args:
    pcfg: the ``config.pipeline`` group (stages, skip, swap, paths, topology, memory, balance,
      seed, search_iters).
    cfg: the model config (its blocks, and the sizes that price a transfer).
    num_mb: microbatches per stage call, over all devices (``devices x k``).
    rows_per_mb: rows per microbatch (B).
  """

  def __init__(self, pcfg, cfg: model.ModelConfig, num_mb: int, rows_per_mb: int):
    self.num_stages = int(pcfg.stages)
    self.blocks = cfg.N
    paths.check_stages(cfg.N, self.num_stages)
    self.k = paths.path_length(self.num_stages, float(pcfg.skip))
    if pcfg.paths not in MODES:
      raise errors.UserValueError(
        f"pipeline.paths={pcfg.paths!r} is unknown: choose one of {', '.join(MODES)}"
      )
    if int(pcfg.memory) < 0 or int(pcfg.balance) < 0:
      raise errors.UserValueError(
        f"pipeline.memory={pcfg.memory} and pipeline.balance={pcfg.balance} must be >= 1 "
        "microbatch (0 picks the default)"
      )
    self.skip, self.swap, self.mode = float(pcfg.skip), bool(pcfg.swap), pcfg.paths
    self.seed, self.num_mb, self.rows = int(pcfg.seed), int(num_mb), int(rows_per_mb)
    self.plan = None
    if self.mode == "scheduled":  # the topology's preset size: these workers are not its nodes
      self.plan = plans.make(pcfg, cfg, 0, self.num_mb, self.rows).plan

  def paths(self, step: int) -> list[paths.Path]:
    """The ``num_mb`` paths of the stage call that reads global batch ``step``."""
    if self.plan is not None:
      return list(self.plan.paths)
    rng = np.random.default_rng([self.seed, int(step)])
    return paths.random_paths(self.num_mb, self.num_stages, self.skip, self.swap, rng)

  def rows_for(self, ps: list[paths.Path]) -> np.ndarray:
    """``[len(ps) * rows_per_mb, K]`` int32: each microbatch's layer order on each of its rows."""
    per_mb = np.stack([paths.layer_order(p, self.blocks, self.num_stages) for p in ps])
    return np.repeat(per_mb, self.rows, axis=0)

  def order_rows(self, step: int) -> np.ndarray:
    return self.rows_for(self.paths(step))

  def stream(self, stream, process_index: int = 0, process_count: int = 1) -> OrderedStream:
    """``stream`` with each batch's layer orders (:class:`OrderedStream`)."""
    return OrderedStream(stream, self, process_index, process_count)

  def prime_rows(self, k: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
    """The priming batch's orders (:func:`prime_rows`)."""
    return prime_rows(self, k, process_index, process_count)


class OrderedStream:
  """A batch stream whose batches carry ``'order'``, this process's rows of the global orders.

  The global batch index (the stream's position before the batch) picks the paths, so a resumed
  stream continues with the same paths.
  """

  def __init__(self, stream, orders: LayerOrders, process_index: int = 0, process_count: int = 1):
    self._stream, self._orders = stream, orders
    self._p, self._count = process_index, process_count

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    step = int(self._stream.get_state()["step"])
    batch = dict(next(self._stream))
    rows = self._orders.order_rows(step)
    local = rows.shape[0] // self._count
    batch["order"] = rows[self._p * local : (self._p + 1) * local]
    return batch

  def get_state(self) -> dict:
    return self._stream.get_state()

  def set_state(self, state: dict) -> None:
    self._stream.set_state(state)


def prime_rows(orders: LayerOrders, k: int, process_index: int = 0, process_count: int = 1):
  """Orders of the priming batch (one microbatch per device): device i takes its first
  microbatch's path of the first iteration."""
  rows = orders.rows_for(orders.paths(0)[::k])
  local = rows.shape[0] // process_count
  return rows[process_index * local : (process_index + 1) * local]
