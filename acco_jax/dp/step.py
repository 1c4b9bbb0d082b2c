"""The data-parallel training step: its state, the jitted stage programs and the public API.

One call of :meth:`TrainStep.step` runs one *stage* of ``k`` microbatches per device as one XLA
program: the jit of the function that :class:`acco_jax.dp.stage.StageProgram` composes from its
per-device blocks (one program per stage kind, state structure and budget mode,
:meth:`TrainStep.stage_program`). Every jitted helper is built once per step object and kept: a stage
loop traces and compiles nothing after its first call of each. That
module holds the math of a stage and every ``shard_map`` and collective over the data axis; this one
what runs around it on the host: the state (:class:`TrainState`) and its shardings, its initial
value (a delayed method starts from one microbatch gradient per device, :meth:`TrainStep.prime`),
which stage kind runs when (a DPU warm-up runs 'sync' stages, one 'fill', then 'delayed' ones), the
placement of batches and per-device microbatch counts, the read-outs (committed parameters,
compute weights), and the state across device counts and run kinds (the checkpoint restore's
``reshard``; ``ckpt.init_from``'s ``export_state`` and ``import_state``: the moves themselves are in
:mod:`acco_jax.dp.reshard`, :mod:`acco_jax.dp.reshard_owner` and :mod:`acco_jax.dp.relayout`).
It implements :class:`acco_jax.step_api.Step`, :class:`~acco_jax.step_api.Probed` and
:class:`~acco_jax.step_api.Portable`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax.dp import layouts, methods, quantize, relayout, reshard_owner
from acco_jax.dp.plan import comm_bytes_per_stage
from acco_jax.dp.quantized_comm import QuantizedComm
from acco_jax.dp.reshard import reshard_state, saved_num_devices
from acco_jax.dp.stage import StageProgram
from acco_jax.step_api import StepBase

PyTree = Any


class TrainState(NamedTuple):
  """Everything a stage reads and writes (a pytree; checkpoint it whole).

  Attributes:
    w: ``[N*S]`` compute weights in ``comm_dtype``, replicated: θ or θ̃ as a flat buffer.
    params: the optimizer's view of the weights, a tree of ``[N, s_l]`` float32 shards, sharded over
      the data axis (replicated for DDP); with the owner layout, its ``shards`` view. For ACCO/WP
      this holds θ̃/θ̂; the committed θ is in the state.
    opt_state: the method transform's state over ``params``, sharded like it.
    buf: ``[N, N*S]`` per-device gradient sums waiting to be reduced (delayed methods), else ``None``.
    buf_count: ``[N]`` int32 microbatch counts of ``buf`` (delayed methods), else ``None``.
    stage: int32 number of stages run.
    residual: ``[N, N*S]`` per-device gradient values a quantized send did not deliver yet (ZeRO-1
      with quantized gradients and error feedback), else ``None``. ACCO keeps them in ``buf``.
  """

  w: jax.Array
  params: PyTree
  opt_state: PyTree
  buf: jax.Array | None
  buf_count: jax.Array | None
  stage: jax.Array
  residual: jax.Array | None = None


class TrainStep(StepBase):
  """A compiled data-parallel training step for one method. Build it with :func:`make_train_step`.

  Attributes:
    layout: the :class:`FlatLayout` of the parameters, or their
      :class:`acco_jax.dp.owner.OwnerLayout` (``layout='owner'``: the optimizer runs vmapped over
      the devices' slots).
    plan: the method's :class:`acco_jax.dp.methods.CommPlan`.
    mesh: the mesh the step runs on.
    num_microbatches: ``k``, microbatches per device per stage (the maximum when counts vary).
    program: the :class:`acco_jax.dp.stage.StageProgram` each stage runs.
    orders: SkipPipe's layer order per microbatch (:class:`acco_jax.skippipe.orders.LayerOrders`,
      ``pipeline.stages > 0``: the config's build sets it), added to each batch by :meth:`feed`;
      None: every microbatch runs the layers in order.
  """

  def __init__(
    self,
    loss_fn,
    tx,
    mesh,
    num_microbatches,
    has_aux,
    params_like,
    skip_nonfinite=False,
    replica_axis=None,
    owned=None,
    elementwise=None,
  ):
    self.plan = methods.comm_plan(tx)
    self.tx = tx
    axis = self.plan.axis_name
    if axis not in mesh.axis_names:
      raise ValueError(
        f"axis_name {axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}; "
        f"build the mesh with an axis named {axis!r} or pass axis_name= to the method"
      )
    others = [a for a in mesh.axis_names if a not in (axis, replica_axis) and mesh.shape[a] > 1]
    if others:
      raise ValueError(f"only data parallelism over {axis!r} is supported; mesh axes {others} > 1")
    inner_ok = not self.plan.delayed or self.plan.two_stage  # ddp, zero1 or acco
    if replica_axis is not None and (not inner_ok or replica_axis not in mesh.axis_names):
      raise ValueError(
        f"workers over {replica_axis!r} need an inner method ddp, zero1 or acco and a mesh "
        f"with that axis; got {self.plan.name!r} on axes {tuple(mesh.axis_names)}"
      )
    self.replica_axis = replica_axis
    self.num_replicas = mesh.shape[replica_axis] if replica_axis else 1
    if num_microbatches < 1:
      raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    super().__init__(
      jax.sharding.Mesh(
        mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * mesh.devices.ndim
      )
    )
    self.num_devices = self.mesh.shape[axis]
    self.num_microbatches = int(num_microbatches)
    self.comm_dtype = jnp.dtype(self.plan.comm_dtype)
    # the method transform on another device count (a checkpoint's: the owner layout's masks are in
    # that count's view); the config's build sets it, a transform with callable masks needs none
    self.source_tx = lambda n: self.tx
    self.orders = None
    # heterogeneous workers: fixed budgets (hetero.budgets), or a policy that moves them
    # (hetero.adaptive: acco_jax.dp.hetero.BudgetPolicy) every adapt_every stages
    self.budgets, self.policy, self.adapt_every = None, None, 1
    # the inner optimizer on the model's tree (ckpt.init_from of the owner layout: its state's
    # portable form); the config's build sets it, a transform with callable masks is its own
    self.tree_inner = getattr(tx, "inner", None)
    # layout='auto' resolved: the owner layout for an inner optimizer that is not elementwise
    self.plan, self.layout, clip = layouts.choose(
      tx, self.plan, params_like, self.num_devices, owned, elementwise, replica_axis
    )
    self.owner = self.plan.sharded and self.plan.layout == "owner"
    self.qcomm = QuantizedComm(self.plan, self.num_devices, self.layout.shard_size, replica_axis)
    self.quantized, self.quantized_reduce = self.qcomm.quantized, self.qcomm.reduce
    self.program = StageProgram(
      loss_fn,
      tx,
      self.plan,
      self.mesh,
      self.layout,
      self.qcomm,
      has_aux,
      self.num_microbatches,
      skip_nonfinite,
      replica_axis,
      global_clip=clip,
    )
    self.keeps_residual = self.program.keeps_residual
    self.num_params = self.layout.num_params
    self._stage_of = None  # (the stage array the last step returned, its value on the host)

  @property
  def microbatches_per_stage(self) -> int:
    return self.num_devices * self.num_microbatches

  def sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  # -- shardings --------------------------------------------------------------------------------

  def leaf_sharding(self, x) -> NamedSharding:
    """Sharding of a state leaf: over the data axis if it is a ``[N, s]`` shard array and the method
    is ZeRO-1, else replicated (within a worker, with workers)."""
    lead = int(self.replica_axis is not None)
    if self.plan.sharded and x.ndim >= 2 + lead and x.shape[lead] == self.num_devices:
      return self.sharding(self.program.spec(self.plan.axis_name))
    return self.sharding(self.program.spec())

  def state_sharding(self, state_shape: TrainState) -> TrainState:
    spec = self.program.spec
    data, rep = self.sharding(spec(self.plan.axis_name)), self.sharding(spec())
    rule = self.leaf_sharding

    def buf_rule(x):
      return None if x is None else data

    return TrainState(
      w=rep,
      params=jax.tree.map(rule, state_shape.params),
      opt_state=jax.tree.map(rule, state_shape.opt_state),
      buf=buf_rule(state_shape.buf),
      buf_count=buf_rule(state_shape.buf_count),
      stage=rep,
      residual=buf_rule(state_shape.residual),
    )

  # -- programs -----------------------------------------------------------------------------------

  def zeros_buf(self):
    """``[N, N*S]`` zeros in ``comm_dtype``: a gradient buffer with nothing in it."""
    return jnp.zeros((self.num_devices, self.layout.padded_size), self.comm_dtype)

  def _zeros_count(self):
    return jnp.zeros((self.num_devices,), jnp.int32)

  def stage_program(self, kind: str, state_like, budgeted: bool = False):
    """The jitted stage program for ``kind`` and the state's structure (``buf`` present or not).

    ``state_like``: a state or its ``ShapeDtypeStruct`` tree; shardings are built only on a miss.
    Without ``budgeted`` the program is ``(state, batch) -> (state, metrics)``: every device runs
    all ``k`` microbatches, in loops whose trip counts XLA knows. ``budgeted``: ``(state, batch,
    counts)``, the per-device counts traced (XLA:GPU steers those loops from the host).
    """
    key = (kind, jax.tree.structure(state_like), budgeted)
    if key not in self.programs:
      state_sharding = self.state_sharding(state_like)
      data = self.sharding(P(self.plan.axis_name))
      stage = with_counts = self.program.stage_fn(kind)
      if not budgeted:  # every device runs all k microbatches: static loop bounds

        def stage(state, batch):
          return with_counts(state, batch, None)

      self.programs[key] = jax.jit(
        stage,
        in_shardings=(state_sharding, data, data)[: 3 if budgeted else 2],
        out_shardings=(state_sharding, self.sharding(P())),
        donate_argnums=(0,),
      )
    return self.programs[key]

  # -- public API ---------------------------------------------------------------------------------

  def initial_state(self, params: PyTree) -> TrainState:
    layout, plan = self.layout, self.plan
    shards = layout.to_shards(params, jnp.float32)
    return TrainState(
      w=layout.ravel(params, self.comm_dtype),
      params=shards,
      opt_state=jax.vmap(self.tx.init)(shards) if self.owner else self.tx.init(shards),
      buf=self.zeros_buf() if plan.delayed else None,
      buf_count=self._zeros_count() if plan.delayed else None,
      stage=jnp.zeros((), jnp.int32),
      residual=self.zeros_buf() if self.keeps_residual else None,
    )

  def init(self, params: PyTree, microbatch: PyTree | None = None) -> TrainState:
    """Builds the sharded train state from float32 parameters (original shapes).

    Delayed methods (ACCO, DPU without warm-up, WP) start with one microbatch gradient at θ_0 per
    device in the buffer (the paper's initial condition); pass that ``microbatch`` (leading dim
    ``N * B``, one microbatch per device).
    """
    plan = self.plan
    state = self.placed_state(params)
    if plan.delayed and plan.warmup_steps == 0:
      state = self.prime(state, microbatch, "init")
    return state

  def prime(self, state: TrainState, microbatch: PyTree, caller: str = "prime") -> TrainState:
    """Fills the buffer with one microbatch gradient per device at the current weights
    (``caller``: the method a missing ``microbatch`` is reported for)."""
    if microbatch is None:
      raise ValueError(
        f"{self.plan.name} starts from one microbatch gradient at its weights: call "
        f"{caller}(..., microbatch) with one microbatch per device (leading dim "
        f"{self.num_devices}*B)"
      )
    batch = self.put_batch(microbatch, per_device=1)
    if "prime" not in self.programs:

      def prime(state, batch):
        buf, count, _ = self.program.accumulate(state.w, batch, None, 1)
        return state._replace(buf=buf, buf_count=count)

      self.programs["prime"] = jax.jit(prime, donate_argnums=(0,))
    return self.programs["prime"](state, batch)

  def step(self, state: TrainState, batch: PyTree, counts=None) -> tuple[TrainState, dict]:
    """Runs one stage; returns the new state (the input is donated) and replicated metrics.

    Args:
      state: the current :class:`TrainState`.
      batch: pytree of arrays with leading dim ``N * k * B`` (device-major: device ``i`` takes the
        ``i``-th contiguous block, split into ``k`` microbatches of ``B``).
      counts: optional ``[N]`` int microbatches per device this stage (``1 <= counts[i] <= k``);
        device ``i`` uses the first ``counts[i]`` microbatches of its block. Default: ``k`` each,
        in loops of static trip count; host counts that are all ``k`` run the same program. Other
        counts (or a placed ``jax.Array`` of them) run the budgeted program, whose loop bounds are
        traced: on a GPU its loops are steered from the host.

    Returns:
      ``(state, metrics)``; metrics: ``loss`` (mean over this stage's microbatches), ``microbatches``
      (summed over devices), ``grad_norm`` (of the mean gradient applied this stage), ``committed``,
      ``stage``, ``skipped`` (microbatches dropped as non-finite), plus the summed aux values of
      ``loss_fn``.
    """
    plan = self.plan
    kind = "delayed" if plan.delayed else "sync"
    if plan.warmup_steps:
      stage = self._host_stage(state)
      kind = "sync" if stage < plan.warmup_steps else "fill" if stage == plan.warmup_steps else kind
    batch = self.put_batch(batch, per_device=self.num_microbatches)
    k = self.num_microbatches
    if counts is not None:
      placed = self.put_counts(counts, k=k)  # checked (host counts) and placed once per value
      counts = None if not isinstance(counts, jax.Array) and np.all(counts == k) else placed
    if counts is None:
      state, metrics = self.stage_program(kind, state)(state, batch)
    else:
      state, metrics = self.stage_program(kind, state, True)(state, batch, counts)
    if plan.warmup_steps:
      self._stage_of = (state.stage, stage + 1)
    return state, metrics

  def _host_stage(self, state: TrainState) -> int:
    """The state's stage count: known on the host when ``state`` is what the last :meth:`step`
    returned (no device read on the hot path), read from the device otherwise."""
    known = self._stage_of
    if known is not None and known[0] is state.stage:
      return known[1]
    return int(jax.device_get(state.stage))

  def params(self, state: TrainState) -> PyTree:
    """The committed parameters θ as a float32 pytree of the original shapes (replicated)."""
    fn = lambda s: self.layout.from_shards(methods.committed_params(s.opt_state, s.params))
    return self.helper("params", fn)(state)

  def compute_params(self, state: TrainState) -> PyTree:
    """The weights the next stage computes at (θ̃ after an ACCO estimate), in ``comm_dtype``."""
    fn = lambda w: self.layout.unravel(w, self.comm_dtype)
    return self.helper("compute_params", fn)(state.w)

  def describe(self) -> str:
    """One line on the quantized communication ('' when the plan quantizes nothing)."""
    return quantize.describe(self.plan, self.num_devices, self.layout.shard_size)

  # -- what the trainer calls beyond init, step and params (acco_jax.step_api.Step) --------------

  def call(self, state: TrainState, batches: list, stage: int, total: int, counts=None):
    """:meth:`step` on the one batch of a stage (the trainer's call)."""
    (batch,) = batches
    return self.step(state, batch, self.budgets if counts is None else counts)

  def optimizer_state(self, state: TrainState) -> PyTree:
    return state.opt_state

  def adapts(self, stage: int, start: int) -> bool:
    return self.policy is not None and (stage == start or stage % self.adapt_every == 0)

  def adapt(self, mb_time_s, comm_time_s: float) -> bool | None:
    if self.policy is None:
      return None
    changed = self.policy.observe(mb_time_s, comm_time_s)
    self.budgets = self.policy.budgets
    return changed

  def feed(self, stream):
    if self.orders is None:
      return stream
    return self.orders.stream(stream, jax.process_index(), jax.process_count())

  def priming_batch(self, batch: dict) -> dict:
    """Device i primes with the path of its first microbatch."""
    if self.orders is None:
      return batch
    k, index, count = self.num_microbatches, jax.process_index(), jax.process_count()
    return {**batch, "order": self.orders.prime_rows(k, index, count)}

  def comm_bytes_per_stage(self) -> float:
    return comm_bytes_per_stage(self.plan, self.layout.padded_size, self.num_devices)

  # -- placement of a stage's inputs --------------------------------------------------------------

  def put_batch(self, batch: PyTree, per_device: int) -> PyTree:
    """A host batch of ``N * per_device * B`` rows placed over the data axis (placed arrays pass)."""
    n = self.num_devices
    for x in jax.tree.leaves(batch):
      if x.ndim < 1 or x.shape[0] % (n * per_device):
        raise ValueError(
          f"batch leading dim {x.shape[0] if x.ndim else 'scalar'} is not divisible by devices x "
          f"microbatches = {n} x {per_device}; use a global batch of {n}*{per_device}*B rows"
        )
    sharding = self.sharding(P(self.plan.axis_name))
    return jax.tree.map(
      lambda x: x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding),
      batch,
    )

  def put_counts(self, counts, k: int) -> jax.Array:
    """Per-device microbatch counts (``None``: ``k`` each) checked and placed over the data axis,
    once per distinct value: re-placing host data every stage is a cross-process check."""
    if isinstance(counts, jax.Array):
      return counts
    counts = np.full((self.num_devices,), k, np.int32) if counts is None else np.asarray(counts)
    if counts.shape != (self.num_devices,) or counts.min() < 1 or counts.max() > k:
      raise ValueError(
        f"counts must be {self.num_devices} ints in [1, {k}] (microbatches per device), got {counts}"
      )
    key = ("counts", k, tuple(int(c) for c in counts))
    if key not in self.programs:
      counts = counts.astype(np.int32)
      self.programs[key] = jax.device_put(counts, self.sharding(P(self.plan.axis_name)))
    return self.programs[key]

  # -- the state across device counts and run kinds -----------------------------------------------

  def reshard(self, saved):
    """A state saved on another device count (host numpy leaves) -> numpy leaves for this step.

    Pass it as ``reshard=`` to :meth:`acco_jax.ckpt.checkpoint.Checkpointer.restore`. Weights and
    optimizer state move bit for bit, the gradient buffers keep their sums over devices
    (:mod:`acco_jax.dp.reshard`); the owner layout's owners are reassigned
    (:mod:`acco_jax.dp.reshard_owner`).
    """
    if self.owner:
      old_tx = self.source_tx(saved_num_devices(saved))
      return reshard_owner.reshard_owner_state(saved, old_tx, self.layout, self.tx, self.comm_dtype)
    return reshard_state(saved, self.layout, self.tx)

  def saved_like(self, shapes: dict):
    """With the owner layout, a state saved on another device count has other slots: its
    structure (``shapes``: path -> saved shape). ``None`` for the other layouts (their paths
    never change)."""
    n = next((s[0] for p, s in shapes.items() if p.startswith(".params") and s), None)
    if not self.owner or n is None:
      return None
    old = reshard_owner.source_layout(self.layout, int(n))
    tx = self.source_tx(int(n))
    return TrainState(**reshard_owner.saved_structure(old, tx, self.plan.delayed, self.comm_dtype))

  def export_state(self, saved):
    """A saved state (host numpy, any device count) -> :class:`acco_jax.ckpt.portable.PortableState`:
    θ and the inner state in the model's structure (:mod:`acco_jax.dp.relayout`)."""
    return relayout.export_state(self, saved)

  def export_params(self, saved) -> PyTree:
    """The committed parameters θ of a saved state (host numpy, any device count), float32 in
    the model's structure (ACCO's and WP's committed copy, not an estimate or prediction)."""
    return relayout.export_state(self, saved).params

  def import_state(self, portable, stage: int, microbatch: PyTree | None = None):
    """The state of a run that starts from ``portable`` at ``stage``, placed; a delayed method
    primes its buffer with ``microbatch`` as :meth:`init` does (:mod:`acco_jax.dp.relayout`)."""
    return relayout.import_state(self, portable, stage, microbatch)

  # -- timing probes (heterogeneous budgets, slow-worker detection) -------------------------------

  def probe(self, state: TrainState, batch: PyTree, repeats: int = 2) -> tuple[float, float]:
    """Seconds per microbatch on this process's devices and of one stage's communication
    (:func:`acco_jax.dp.probe.probe`)."""
    from acco_jax.dp.probe import probe

    return probe(self, state, batch, repeats)


def make_train_step(
  loss_fn: Callable,
  tx,
  mesh: jax.sharding.Mesh,
  *,
  num_microbatches: int,
  params: PyTree,
  has_aux: bool = False,
  skip_nonfinite: bool = False,
  owned=None,
  elementwise: bool | None = None,
) -> TrainStep:
  """Builds the data-parallel training step of a method.

  Example::

    tx = acco_jax.acco(optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    train = acco_jax.make_train_step(loss_fn, tx, mesh, num_microbatches=4, params=params)
    state = train.init(params, first_microbatch)
    for batch in batches:
      state, metrics = train.step(state, batch)
    final = train.params(state)

  Args:
    loss_fn: ``loss_fn(params, microbatch) -> loss`` (or ``(loss, aux)`` with ``has_aux``): the mean
      loss of one microbatch; aux is a dict of scalars summed over microbatches and devices.
      ``params`` arrive in the method's ``comm_dtype``.
    tx: a method transform (:func:`acco_jax.acco`, ``ddp``, ``zero1``, ``dpu``, ``wp``).
    mesh: a mesh with the method's data axis (other axes must have size 1).
    num_microbatches: ``k``, microbatches per device per stage. An ACCO update spans two stages
      (``2k`` microbatches per device); the others update every stage.
    params: the parameters, or a tree of ``jax.ShapeDtypeStruct`` with their shapes.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    skip_nonfinite: drop every microbatch whose loss or gradient is not finite (its gradient and
      its count), so buffers and ACCO's accumulator stay finite and the mean is over the good
      microbatches; a stage with no good microbatch anywhere leaves weights and optimizer state
      unchanged. Off by default (a non-finite loss then shows in the metrics).
    owned: with ``layout='owner'``, which leaves are owned whole (a tree of bools like ``params``
      or a function of a leaf; the others are split elementwise); default every leaf. The inner
      optimizer then sees :meth:`acco_jax.dp.owner.OwnerLayout.view`'s structure: build its
      masks with that method.
    elementwise: whether the inner optimizer updates each element on its own (if not, DDP gives
      it whole leaves, and ``layout='auto'`` gives acco and zero1 the owner layout). Default: judged
      by its state shapes, which a Muon masked to elementwise-shaped state passes: say ``False``.

  Returns:
    A :class:`TrainStep` with ``init``, ``step``, ``params`` and ``compute_params``.
  """
  return TrainStep(
    loss_fn,
    tx,
    mesh,
    num_microbatches,
    has_aux,
    params,
    skip_nonfinite,
    owned=owned,
    elementwise=elementwise,
  )
