"""What the run shell calls of a family's step: :class:`Step`, and :class:`StepBase`, the part every
family's step shares; :func:`ring_bytes`, the count every step's ``comm_bytes_per_stage`` reports.

The interface sits below both the shell and the families, so that a family's step imports no
module of the run shell (``tests/import_graph_test.py``).

A family's build (:class:`acco_jax.family_api.Family`) returns a :class:`acco_jax.family_api.Run`
whose ``step`` is a :class:`Step`: the data-parallel :class:`acco_jax.dp.step.TrainStep`, the
low-communication :class:`acco_jax.loco.step.LocoStep` and the pipeline's
:class:`acco_jax.pipeline.step.PipelineStep`. The trainer (:mod:`acco_jax.run.trainer`), the
checkpoint restore (:mod:`acco_jax.run.start`), ``ckpt.init_from``, ``model.init=run:`` and the
export (:mod:`acco_jax.run.saved`) call it through this interface and nothing else.

The hot path is one call: :meth:`Step.call` takes the batches of :meth:`Step.call_stages` stages
(one, or a LoCo window's or phase's inner steps) and returns the state and the device metrics of
the call; the host reads nothing in between. Units as in the trainer: a *stage* is one program
call of ``k`` microbatches per device (ACCO: an estimate or a commit); the checkpoint's step
number counts stages.

Two capabilities are not every family's, so they are protocols of their own, and a step that
lacks one does not define its methods: :class:`Probed` (timing probes for heterogeneous budgets and
slow-worker detection: the data-parallel step) and :class:`Portable` (its state in the model's own
structure, to start another run kind from it: ``ckpt.init_from``; data-parallel and pipeline).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any

# The device metrics every :meth:`Step.call` returns (a log row's fields; LoCo: per worker).
METRICS = ("loss", "grad_norm", "microbatches", "committed", "skipped")
# The one metric a call may add for the shell: where the call's outer sync was finite (per worker;
# the low-communication steps). Absent: nothing but the loss can be non-finite. The trainer's
# non-finite check (``train.on_nonfinite``) reads it with the loss.
OUTER_FINITE = "outer_finite"


@runtime_checkable
class Step(Protocol):
  """A family's compiled training step, as the run shell sees it.

  Attributes:
    mesh: the mesh the state is laid out over.
    num_devices: devices the step's data axis spans (a LoCo worker's devices; the data-parallel
      and pipeline steps: every device of the mesh that takes a share of a batch's rows).
    num_microbatches: ``k``, microbatches per device per stage (the header line's ``k/stage``).
    microbatches_per_stage: microbatches one stage takes from the data stream (rows per stage /
      ``batch.microbatch_size``).
    num_params: the model's parameter count.
    keeps_residual: whether the state holds the residual of quantized sends (recorded with each
      checkpoint: a resumed run must keep or lack it alike).
    data_share: ``(i, n)``: this job is worker ``i`` of ``n`` jobs and reads share ``i`` of each
      global batch (LoCo workers as separate jobs); ``(0, 1)``: the whole batch.
    budgets: every device's microbatches per stage (heterogeneous workers: ``hetero``), a host int
      array, or None: ``num_microbatches`` each.
  """

  mesh: Any
  num_devices: int
  num_microbatches: int
  microbatches_per_stage: int
  num_params: int
  keeps_residual: bool
  data_share: tuple[int, int]
  budgets: Any

  def abstract_state(self, params_shapes: PyTree) -> PyTree:
    """``jax.ShapeDtypeStruct`` tree of the state, with shardings (a checkpoint restore target)."""

  def init(self, params: PyTree, microbatch: PyTree | None = None) -> PyTree:
    """The placed state from float32 parameters; a delayed method primes its buffer with
    ``microbatch`` (one microbatch per device)."""

  def call_stages(self, stage: int, total: int) -> int:
    """Stages the call that starts after ``stage`` of ``total`` runs (the batches it takes)."""

  def call(self, state, batches: list, stage: int, total: int, counts=None) -> tuple[Any, dict]:
    """Runs ``len(batches) == call_stages(stage, total)`` stages; returns the state (the input
    is donated) and the call's device metrics: every key of :data:`METRICS`, maybe
    :data:`OUTER_FINITE`, and what the step's own :meth:`log_fields` and :meth:`outer_metrics`
    read. ``counts``: per-device microbatch budgets, or ``None``: the step's :attr:`budgets`."""

  def watch_stop(self, requested) -> None:
    """From now on ``requested()`` says whether the run was asked to stop (SIGTERM/SIGINT): a
    step that waits for other jobs within a call (LoCo workers meeting through a store) gives the
    wait up once it is true, so that the trainer checkpoints and stops at once."""

  def feed(self, stream):
    """This process's host batches as the step takes them: ``stream`` itself, or with what a
    family adds to each batch (SkipPipe's paths: each microbatch's layer order, ``'order'``)."""

  def priming_batch(self, batch: dict) -> dict:
    """The priming batch (one microbatch per device, host rows of the stream seeded
    ``train.seed + 1``) as the step takes it, like :meth:`feed`'s batches."""

  def sent_bytes(self, stage: int, total: int) -> float:
    """Bytes one worker sends to the others in the call that starts after ``stage`` (the
    low-communication methods' outer syncs; 0 where every device is one worker)."""

  def comm_bytes_per_stage(self) -> float:
    """Bytes one device sends per stage within its worker, with ring collectives."""

  def params(self, state) -> PyTree:
    """The committed parameters, float32 in the model's structure, replicated."""

  def optimizer_state(self, state) -> PyTree:
    """The state of the optimizer whose schedule the log reports (the inner one under LoCo)."""

  def replicated(self, tree: PyTree) -> PyTree:
    """A copy of every array of ``tree`` on every device (readable on every process)."""

  def log_fields(self, metrics: dict, sent: float) -> dict:
    """A log row's fields from a stage's host metrics and the bytes sent so far per worker."""

  def outer_metrics(self, metrics: dict) -> dict | None:
    """The metrics of a call that ran an outer sync (device values, known by their keys: no
    device read), or ``None``: kept for :meth:`sync_row` at the next log row."""

  def sync_row(self, metrics: dict) -> dict:
    """The log row of an outer sync from :meth:`outer_metrics`' values, read on the host."""

  def summary(self, sent: float) -> dict:
    """The run's summary fields beyond loss and evaluation (the bytes a worker sent, ...)."""

  def describe(self) -> str:
    """One line on what the step does beyond the header ('' when nothing)."""

  def checkpoint_extra(self) -> dict:
    """What a checkpoint records beyond the state (read back by :meth:`check_checkpoint`)."""

  def check_checkpoint(self, extra: dict) -> None:
    """Refuses, before any array is read, a checkpoint this step cannot continue (one line)."""

  def saved_like(self, shapes: dict) -> PyTree | None:
    """The structure of a checkpoint whose leaf paths differ from :meth:`abstract_state`'s
    (``shapes``: path -> saved shape), or ``None``: the paths never change."""

  def reshard(self, saved: PyTree) -> PyTree:
    """A state saved on another mesh (host numpy leaves, as written) made this step's (host
    numpy leaves), or a one-line refusal: ``Checkpointer.restore``'s ``reshard``."""

  def export_params(self, saved: PyTree) -> PyTree:
    """The committed parameters of a saved state (host numpy, as written), float32 numpy leaves
    in the model's structure (``python -m acco_jax.export``, ``model.init=run:``)."""


@runtime_checkable
class Probed(Protocol):
  """A step whose devices can be timed apart from training (``health.probe_every``,
  ``hetero.adaptive``)."""

  def probe(self, state, batch: PyTree, repeats: int = 2) -> tuple[float, float]:
    """Seconds per microbatch on this process's devices, and of one stage's communication."""

  def adapts(self, stage: int, start: int) -> bool:
    """Whether the budgets want a probe before stage ``stage`` (``start``: this process's first)."""

  def adapt(self, mb_time_s, comm_time_s: float) -> bool | None:
    """New :attr:`Step.budgets` from a probe: every device's seconds per microbatch and the
    stage's communication; whether they changed, or None: the budgets do not adapt."""


@runtime_checkable
class Portable(Protocol):
  """A step whose state moves to and from the model's own structure (``ckpt.init_from`` across run
  kinds: :mod:`acco_jax.ckpt.portable`)."""

  def export_state(self, saved: PyTree):
    """A saved state (host numpy) -> :class:`acco_jax.ckpt.portable.PortableState`."""

  def import_state(self, portable, stage: int, microbatch: PyTree | None = None) -> PyTree:
    """This step's placed state from the portable form, at ``stage``."""


def ring_bytes(nbytes: float, num_devices: int) -> float:
  r"""Bytes one device sends to reduce ``nbytes`` over ``num_devices`` devices with ring collectives.

  A ring all-reduce, or its halves, a reduce-scatter then an all-gather, moves
  :math:`2 \frac{N-1}{N} \cdot \text{nbytes}` per device (each half :math:`\frac{N-1}{N}`); one
  device sends nothing.
  """
  n = num_devices
  return 0.0 if n <= 1 else 2 * (n - 1) * nbytes / n


class StepBase:
  """What every family's step shares: its jitted programs and helpers built once and kept, the
  state's placed initial value and abstract shape from one traceable :meth:`initial_state`, and
  the defaults of :class:`Step` for a family without outer syncs or checkpoint extras.

  A subclass calls ``super().__init__(mesh)`` and defines :meth:`initial_state` and
  :meth:`state_sharding`.

  Attributes:
    mesh: the mesh the state is laid out over.
    programs: every jitted program and helper of the step by key, built on first use.
  """

  keeps_residual = False
  budgets = None
  data_share = (0, 1)  # (i, n): a job that is worker i of n reads share i of each global batch

  def __init__(self, mesh):
    self.mesh = mesh
    self.programs: dict = {}

  def initial_state(self, params: PyTree) -> PyTree:
    """The state from float32 parameters of the model's shapes (traceable, not placed)."""
    raise NotImplementedError

  def state_sharding(self, shapes: PyTree) -> PyTree:
    """The sharding of each leaf of a state of these shapes."""
    raise NotImplementedError

  def helper(self, name: str, fn, **jit_kwargs):
    """``jax.jit(fn)`` with replicated results, built on the first call for ``name`` and kept: a
    new jit object per call retraces, and reads the persistent compilation cache, every time."""
    if name not in self.programs:
      rep = NamedSharding(self.mesh, P())
      self.programs[name] = jax.jit(fn, out_shardings=rep, **jit_kwargs)
    return self.programs[name]

  def abstract_state(self, params_shapes: PyTree) -> PyTree:
    shapes = jax.eval_shape(self.initial_state, params_shapes)
    return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      shapes,
      self.state_sharding(shapes),
    )

  def placed_state(self, params: PyTree) -> PyTree:
    """:meth:`initial_state` placed as :meth:`abstract_state` says, in one program."""
    sharding = jax.tree.map(lambda s: s.sharding, self.abstract_state(params))
    return jax.jit(self.initial_state, out_shardings=sharding)(params)

  def replicated(self, tree: PyTree) -> PyTree:
    return self.helper("replicated", lambda t: jax.tree.map(jnp.copy, t))(tree)

  def call_stages(self, stage: int, total: int) -> int:
    return 1

  def watch_stop(self, requested) -> None:
    return None

  def feed(self, stream):
    return stream

  def priming_batch(self, batch: dict) -> dict:
    return batch

  def sent_bytes(self, stage: int, total: int) -> float:
    return 0.0

  def log_fields(self, metrics: dict, sent: float) -> dict:
    return {}

  def outer_metrics(self, metrics: dict) -> dict | None:
    return None

  def sync_row(self, metrics: dict) -> dict:
    raise ValueError("a step without outer syncs has no sync rows (its outer_metrics is None)")

  def summary(self, sent: float) -> dict:
    return {}

  def describe(self) -> str:
    return ""

  def checkpoint_extra(self) -> dict:
    return {}

  def check_checkpoint(self, extra: dict) -> None:
    return None

  def saved_like(self, shapes: dict) -> PyTree | None:
    return None
