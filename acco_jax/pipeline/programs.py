"""A pipeline over the ``stage`` mesh axis that runs a :class:`~acco_jax.pipeline.ticks.Schedule`.

The only pipeline module with ``shard_map`` and collectives. Placement: each stage's parameters are
packed into flat buffers (:mod:`acco_jax.pipeline.packing`), ``{g: [S, P_g]}`` sharded over
``stage``: stage ``s`` holds its ``counts[s]`` blocks, and stage 0 also the embedding, the final
LayerNorm and the tied head (``shared``), held nowhere else. Stages may hold different numbers of
blocks: every stage runs the same program over ``K = max(counts)`` block slots and skips the slots
past its own count (``layers.run_blocks(..., count)``). On an optional ``('data', 'stage')`` mesh
each data lane runs the same schedule on its own rows of every microbatch, and the lanes' gradients
are averaged (``reduce='mean'``), reduce-scattered (ZeRO-1) or left per lane (ACCO, reduced during
the next flush by :func:`reduce_lanes`); :func:`gather_lanes` is ZeRO-1's all-gather.

**One compiled program per schedule.** A ``lax.scan`` runs the ticks; its inputs are the tick tables.
Per tick each device reads its row (``axis_index('stage')``), runs its operation through a
``lax.switch`` over {idle, F0, F, H, B, B0}, then for each round ``r`` a ``lax.switch`` over the
schedule's distinct static permutations (every device takes the same branch) runs one ``ppermute``
and stores what arrives into the slot the table names. A scan rather than unrolled ticks: the
program and its compile time do not grow with the tick count, and a schedule with other paths but
the same shapes (ticks, rounds, slots, permutations) reuses it.

**Backward by rematerialisation.** A stage keeps only its *inputs* (one [B, L, D] activation per
microbatch in flight, in the slots of the buffer); B recomputes the stage's forward inside
``jax.vjp`` and pulls the cotangent back. Activation memory per device is therefore
``(slots + 1) * B * L * D`` elements (``Schedule.slots``: 1F1B keeps fewer than GPipe) plus one
stage's residuals while one B runs, instead of every microbatch's residuals of every block
(attention probabilities and MLP hiddens). The price is one more forward per stage and microbatch
(B costs about 3 forwards instead of 2).

The result is the mean over microbatches (and data lanes) of ``layers.loss_fn_ordered`` with each
microbatch's layer order (stage 0's blocks, then each visited stage's), and its gradient, in the
buffers' layout: the embedding's gradients from the head (H) and from the input (B0) meet on stage
0, the only stage that holds it, so no collective over ``stage`` carries parameter gradients.

**Mesh-wide schedules** (``Schedule.lanes > 0``, :func:`acco_jax.pipeline.ticks.from_plan`): the
tables have a column per device of the ``('data', 'stage')`` mesh, read at the device's linear index
``lane * S + stage``, and each round's ``ppermute`` runs over both axes, so a microbatch changes
lanes between stages. Microbatches are whole (every device sees the batch; a microbatch's origin
reads its rows), each operation adds ``1 / M`` of its microbatch's loss and gradient, and the
lanes that hold a stage *sum* their gradients over ``data``: the mean over the M microbatches of the
whole mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax import layers, model
from acco_jax.dp.quantized_comm import all_gather_invariant
from acco_jax.pipeline import packing as packing_lib
from acco_jax.pipeline import ticks

STAGE, DATA = "stage", "data"


def make_mesh(num_stages: int, data_lanes: int = 1, devices=None) -> jax.sharding.Mesh:
  """A ``('stage',)`` mesh, or ``('data', 'stage')`` with ``data_lanes > 1``, over the first devices."""
  devices = list(devices if devices is not None else jax.devices())[: num_stages * data_lanes]
  if len(devices) < num_stages * data_lanes:
    raise ValueError(
      f"{num_stages} stages x {data_lanes} lanes need more than {len(devices)} devices"
    )
  auto = jax.sharding.AxisType.Auto
  if data_lanes == 1:
    return jax.sharding.Mesh(np.array(devices), (STAGE,), axis_types=(auto,))
  arr = np.array(devices).reshape(data_lanes, num_stages)
  return jax.sharding.Mesh(arr, (DATA, STAGE), axis_types=(auto, auto))


def packing_for(params_like, num_stages: int, counts=None, lanes: int = 1, matrices=None):
  """The :class:`acco_jax.pipeline.packing.StagePacking` of a model on ``num_stages`` stages:
  ``counts`` blocks per stage (default: equal stages), buffers a multiple of ``lanes`` long, and
  ``matrices`` (a block's mask) whole in slots that ``lanes`` divides."""
  n = len(params_like[model.BLOCKS])
  counts = packing_lib.equal_counts(n, num_stages) if counts is None else counts
  return packing_lib.StagePacking(params_like, counts, multiple=lanes, matrices=matrices)


def param_spec(mesh, sharded: bool = False) -> P:
  """Buffers ``[S, P_g]``: over ``stage``, and over ``data`` too when ``sharded`` (ZeRO-1, ACCO)."""
  return P(STAGE, DATA) if sharded and DATA in mesh.axis_names else P(STAGE)


def place_params(packed: dict, mesh, sharded: bool = False) -> dict:
  spec = NamedSharding(mesh, param_spec(mesh, sharded))
  return jax.tree.map(lambda x: jax.device_put(x, spec), packed)


def batch_spec(mesh, schedule: ticks.Schedule | None = None) -> P:
  """Microbatches [M, B, L]: rows split over ``data`` lanes, or whole on every device for a
  mesh-wide schedule."""
  wide = schedule is not None and schedule.mesh_wide
  return P(None, DATA) if DATA in mesh.axis_names and not wide else P()


def place_batch(batch: dict, mesh, schedule: ticks.Schedule | None = None) -> dict:
  """``{'inputs', 'targets'[, 'weights']}`` of shape [M, B, L] (see :func:`batch_spec`)."""
  spec = NamedSharding(mesh, batch_spec(mesh, schedule))
  return jax.tree.map(lambda x: jax.device_put(x, spec), batch)


REDUCE = ("mean", "scatter", "none")


# Over 80 lines with its docstring (what each reduction returns), the checks of the mesh against the
# schedule and the scan of the tick tables; the ticks' operations are in _tick_ops.
def make_loss_and_grad(
  cfg: model.ModelConfig, mesh, schedule: ticks.Schedule, packing, reduce: str = "mean"
):
  """``f(packed, batch) -> (loss, grads)``, jittable, for batches of shape [M, B, L].

  Args:
    cfg: the model's config.
    mesh: a mesh of :func:`make_mesh`.
    schedule: the tick tables every call runs.
    packing: the :class:`acco_jax.pipeline.packing.StagePacking` of ``packed`` (its ``counts``
      blocks per stage; ``slots`` of them stacked per stage).
    reduce: what becomes of the data lanes' gradients:

      ``mean``: their mean, ``{g: [S, P_g]}`` sharded over ``stage`` (DDP over the lanes);
      ``scatter``: the same mean reduce-scattered, sharded over ``stage`` and ``data`` (ZeRO-1);
      ``none``: each lane's share, ``{g: [lanes, S, P_g]}`` sharded over ``data`` and ``stage``,
      whose sum over lanes is the mean (ACCO reduces it during the next flush).

  ``packed`` is ``{g: [S, P_g]}`` sharded over ``stage`` (any float dtype; the gradients are taken at
  its float32 values). ``loss`` is the mean over the microbatches (and, per-lane tables, the data
  lanes) of each microbatch's token-mean cross-entropy.
  """
  if reduce not in REDUCE:
    raise ValueError(f"reduce={reduce!r}: choose one of {', '.join(REDUCE)}")
  M, S = schedule.num_microbatches, schedule.num_stages
  if mesh.shape[STAGE] != S or packing.num_stages != S:
    raise ValueError(
      f"mesh has {mesh.shape[STAGE]} stages, packing {packing.num_stages}, schedule {S}"
    )
  lanes = mesh.shape.get(DATA, 1)
  axes = tuple(mesh.axis_names)
  wide = schedule.mesh_wide
  if wide and schedule.lanes != lanes:
    raise ValueError(f"mesh has {lanes} data lanes, the schedule {schedule.lanes}")
  cols = axes if wide else STAGE  # the axes a table column and a permutation range over
  tables = {
    k: jnp.asarray(getattr(schedule, k))
    for k in ("kind", "mb", "slot_x", "slot_g", "local", "perm", "recv")
  }
  moves = [lambda v: jnp.zeros_like(v)] + [
    (lambda v, p=p: jax.lax.ppermute(v, cols, p)) for p in schedule.perms[1:]
  ]
  counts_S = jnp.asarray(packing.counts, jnp.int32)
  starts_S = jnp.asarray(packing.starts, jnp.int32)
  vary = lambda x, names=axes: jax.tree.map(lambda v: jax.lax.pcast(v, names, to="varying"), x)

  def body(packed, batch):
    local = {g: v[0].astype(jnp.float32) for g, v in packed.items()}
    if lanes > 1:
      local = vary(local, (DATA,))
    blocks, shared = packing.blocks(local), packing.shared(local)
    B, L = batch["inputs"].shape[1:]
    me = jax.lax.axis_index(cols)
    # equal stages run every slot: no per-slot cond (it would keep each slot's residuals apart)
    count = None if len(set(packing.counts)) == 1 else counts_S[jax.lax.axis_index(STAGE)]
    first_layer = starts_S[jax.lax.axis_index(STAGE)]  # the model's index of the stage's slot 0
    order = jnp.arange(packing.slots)
    run = lambda bl, x: layers.run_blocks(bl, cfg, x, order, count, first_layer)
    zero_x = vary(jnp.zeros((B, L, cfg.D), jnp.dtype(cfg.dtype)))
    ops = _tick_ops(cfg, M, blocks, shared, batch, run, zero_x)

    def tick(carry, row):
      buf, acc = carry
      x, g = buf[row["slot_x"][me]], buf[row["slot_g"][me]]
      out, acc = jax.lax.switch(row["kind"][me], ops, x, g, row["mb"][me], acc)
      buf = buf.at[row["local"][me]].set(out)
      for r in range(row["perm"].shape[0]):
        got = jax.lax.switch(row["perm"][r], moves, out)
        buf = buf.at[row["recv"][r][me]].set(got)
      return (buf, acc), None

    buf = vary(jnp.zeros((schedule.slots + 1, B, L, cfg.D), jnp.dtype(cfg.dtype)))
    f32 = lambda t: jax.tree.map(lambda v: jnp.zeros(v.shape, jnp.float32), t)
    acc = (vary(f32(blocks)), vary(f32(shared)), vary(jnp.zeros(())))
    (_, (db, ds, loss)), _ = jax.lax.scan(tick, (buf, acc), tables)
    grads = packing.grads(local, db, ds)  # only stage 0's devices have embedding/head gradients
    return _over_lanes(jax.lax.psum(loss, STAGE), grads, lanes, wide, reduce)

  def loss_and_grad(packed, batch):
    bspec = jax.tree.map(lambda _: batch_spec(mesh, schedule), batch)
    pspec = jax.tree.map(lambda _: P(STAGE), packed)
    if reduce == "none":
      gspec = P(DATA if lanes > 1 else None, STAGE)
    else:
      gspec = param_spec(mesh, sharded=reduce == "scatter")
    fn = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(pspec, bspec),
      out_specs=(P(), jax.tree.map(lambda _: gspec, packed)),
    )
    return fn(packed, batch)

  return loss_and_grad


def _tick_ops(cfg, M: int, blocks, shared, batch, run, zero_x) -> list:
  """The operations a tick table names (idle, F0, F, H, B, B0), each ``(x, g, mb, acc) -> (out,
  acc)`` with ``acc = (d_blocks, d_shared, loss)``: forward through the stage's blocks (F0 from
  the embedding), the head's loss and its backward (H), and the blocks' backward (B0 into the
  embedding)."""

  def first(bl, sh, mb):
    return run(bl, layers.embed(sh, cfg, batch["inputs"][mb]))

  def head(sh, x, mb):
    b = {k: v[mb] for k, v in batch.items()}
    return layers.head_loss(sh, cfg, x, b)

  def op_idle(x, g, mb, acc):
    return zero_x, acc

  def op_f0(x, g, mb, acc):
    return first(blocks, shared, mb), acc

  def op_f(x, g, mb, acc):
    return run(blocks, x), acc

  def op_h(x, g, mb, acc):
    loss, pull, _ = jax.vjp(lambda sh, x: head(sh, x, mb), shared, x, has_aux=True)
    d_sh, d_x = pull(jnp.ones_like(loss) / M)
    db, ds, ls = acc
    return d_x.astype(x.dtype), (db, jax.tree.map(jnp.add, ds, d_sh), ls + loss / M)

  def op_b(x, g, mb, acc):
    _, pull = jax.vjp(run, blocks, x)
    d_bl, d_x = pull(g)
    db, ds, ls = acc
    return d_x, (jax.tree.map(jnp.add, db, d_bl), ds, ls)

  def op_b0(x, g, mb, acc):
    _, pull = jax.vjp(lambda bl, sh: first(bl, sh, mb), blocks, shared)
    d_bl, d_sh = pull(g)
    db, ds, ls = acc
    return zero_x, (jax.tree.map(jnp.add, db, d_bl), jax.tree.map(jnp.add, ds, d_sh), ls)

  return [op_idle, op_f0, op_f, op_h, op_b, op_b0]


def _over_lanes(loss, grads, lanes: int, wide: bool, reduce: str):
  """A device's loss and gradients made the flush's: summed over the data lanes, and the
  gradients reduced as ``reduce`` says (:func:`make_loss_and_grad`), with their leading axes."""
  if lanes > 1:
    # mesh-wide tables: each device added 1/M of the whole mesh's microbatches (a sum over the
    # lanes is the mean); per-lane tables: each lane's own mean (the mean over lanes is)
    share = 1.0 if wide else 1.0 / lanes
    loss = jax.lax.psum(loss, DATA) * share
    grads = jax.tree.map(lambda v: v * share, grads)
    if reduce == "mean":
      grads = jax.lax.psum(grads, DATA)
    elif reduce == "scatter":
      grads = jax.lax.psum_scatter(grads, DATA, scatter_dimension=0, tiled=True)
  if reduce == "none":
    return loss, jax.tree.map(lambda v: v[None, None], grads)
  return loss, jax.tree.map(lambda v: v[None], grads)


def reduce_lanes(buf: dict, mesh, count) -> dict:
  """ACCO's reduction over the lanes: ``{g: [lanes, S, P_g]}`` (over ``data`` and ``stage``, each
  lane's share) -> their sum divided by ``count``, float32 ``{g: [S, P_g]}`` over ``stage`` and
  ``data`` (one reduce-scatter per buffer, in the buffer's dtype).

  It reads only the buffer, so in a step that also runs a flush it has no data dependence on the
  flush and XLA may keep it in flight while the flush computes."""
  if DATA not in mesh.axis_names:
    return jax.tree.map(lambda v: v[0].astype(jnp.float32) / count, buf)

  def local(buf_1x1xP):
    g_Q = jax.lax.psum_scatter(buf_1x1xP[0, 0], DATA, scatter_dimension=0, tiled=True)
    return g_Q[None].astype(jnp.float32)

  fn = jax.shard_map(local, mesh=mesh, in_specs=P(DATA, STAGE), out_specs=P(STAGE, DATA))
  return jax.tree.map(lambda v: fn(v) / count, buf)


def gather_lanes(params: dict, mesh, dtype) -> dict:
  """ZeRO-1's all-gather over the lanes: ``{g: [S, P_g]}`` over ``stage`` and ``data`` -> the same
  in ``dtype``, whole on every lane of a stage (over ``stage`` only)."""
  if DATA not in mesh.axis_names:
    return jax.tree.map(lambda v: v.astype(dtype), params)

  def local(rows_1xQ):
    return all_gather_invariant(rows_1xQ[0].astype(dtype), DATA)[None]

  fn = jax.shard_map(local, mesh=mesh, in_specs=P(STAGE, DATA), out_specs=P(STAGE))
  return jax.tree.map(fn, params)
