"""A pipeline over the ``stage`` mesh axis that runs a :class:`~acco_jax.pipeline.ticks.Schedule`.

The only pipeline module with ``shard_map`` and collectives. Placement: the model's N blocks are
stacked (``layers.stack_blocks``) and the leading axis is sharded over ``stage``, so stage ``s`` holds
blocks ``s*N/S .. (s+1)*N/S - 1``. The embedding, the final LayerNorm and the head (``shared``) are
replicated and used by stage 0 only. On an optional ``('data', 'stage')`` mesh each data lane runs
the same schedule on its own rows of every microbatch.

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
microbatch's layer order ``paths.layer_order(path)``, and its gradient: block gradients come back
sharded over ``stage``; the shared parameters' gradient is summed over ``stage`` (only stage 0 adds
to it: one all-reduce of the embedding-sized gradient per step). Over ``data`` gradients are averaged
with ``pmean``.

**Mesh-wide schedules** (``Schedule.lanes > 0``, :func:`acco_jax.pipeline.ticks.from_plan`): the
tables have a column per device of the ``('data', 'stage')`` mesh, read at the device's linear index
``lane * S + stage``, and each round's ``ppermute`` runs over both axes, so a microbatch changes
lanes between stages. Microbatches are whole (every device sees the batch; a microbatch's origin
reads its rows), each operation adds ``1 / M`` of its microbatch's loss and gradient, and the
lanes that hold a stage *sum* their block gradients (``psum`` over ``data``; the shared parameters'
over both axes): the mean over the M microbatches of the whole mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax import layers, model
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


def split_params(params: model.Params) -> dict:
  """Model parameters -> ``{'blocks': stacked [N, ...], 'shared': {wte, wpe, ln_f}}``."""
  return {
    "blocks": layers.stack_blocks(params["blocks"]),
    "shared": {k: v for k, v in params.items() if k != "blocks"},
  }


def merge_params(pipe: dict) -> model.Params:
  """The inverse of :func:`split_params`."""
  return {**pipe["shared"], "blocks": layers.unstack_blocks(pipe["blocks"])}


def param_specs(pipe) -> dict:
  """PartitionSpecs: blocks sharded over ``stage`` on their leading axis, shared replicated."""
  return {
    "blocks": jax.tree.map(lambda _: P(STAGE), pipe["blocks"]),
    "shared": jax.tree.map(lambda _: P(), pipe["shared"]),
  }


def place_params(pipe: dict, mesh) -> dict:
  return jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), pipe, param_specs(pipe)
  )


def batch_spec(mesh, schedule: ticks.Schedule | None = None) -> P:
  """Microbatches [M, B, L]: rows split over ``data`` lanes, or whole on every device for a
  mesh-wide schedule."""
  wide = schedule is not None and schedule.mesh_wide
  return P(None, DATA) if DATA in mesh.axis_names and not wide else P()


def place_batch(batch: dict, mesh, schedule: ticks.Schedule | None = None) -> dict:
  """``{'inputs', 'targets'[, 'weights']}`` of shape [M, B, L] (see :func:`batch_spec`)."""
  spec = NamedSharding(mesh, batch_spec(mesh, schedule))
  return jax.tree.map(lambda x: jax.device_put(x, spec), batch)


def make_loss_and_grad(cfg: model.GPTConfig, mesh, schedule: ticks.Schedule):
  """``f(pipe_params, batch) -> (loss, grads)``, jittable, for the batches of shape [M, B, L].

  ``loss`` is the mean over the M microbatches (and, per-lane tables, the data lanes) of each
  microbatch's token-mean cross-entropy; ``grads`` has the structure and shardings of ``pipe_params``.
  """
  M, S = schedule.num_microbatches, schedule.num_stages
  if mesh.shape[STAGE] != S:
    raise ValueError(f"mesh has {mesh.shape[STAGE]} stages, schedule {S}")
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
  perms = schedule.perms

  def vary(x, names=axes):
    return jax.tree.map(lambda v: jax.lax.pcast(v, names, to="varying"), x)

  def body(blocks, shared, batch):
    if lanes > 1:
      blocks = vary(blocks, (DATA,))
    shared = vary(shared)
    B, L = batch["inputs"].shape[1:]
    me = jax.lax.axis_index(cols)
    zero_x = vary(jnp.zeros((B, L, cfg.D), jnp.dtype(cfg.dtype)))
    order = jnp.arange(jax.tree.leaves(blocks)[0].shape[0])
    run = lambda bl, x: layers.run_blocks(bl, cfg, x, order)

    def first(bl, sh, mb):
      return run(bl, layers.embed(sh, cfg, batch["inputs"][mb]))

    def head(sh, x, mb):
      b = {k: v[mb] for k, v in batch.items()}
      return layers.head_loss(sh, cfg, x, b)

    # operations: (x, g, mb, acc) -> (out, acc); acc = (d_blocks, d_shared, loss)
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

    ops = [op_idle, op_f0, op_f, op_h, op_b, op_b0]
    moves = [lambda v: jnp.zeros_like(v)] + [
      (lambda v, p=p: jax.lax.ppermute(v, cols, p)) for p in perms[1:]
    ]

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
    if wide:  # each device added 1/M of its microbatches: sum over the mesh
      loss, ds = jax.lax.psum((loss, ds), axes)
      if lanes > 1:
        db = jax.lax.psum(db, DATA)
      return loss, db, ds
    loss, ds = jax.lax.psum((loss, ds), STAGE)
    if lanes > 1:
      loss, db, ds = jax.lax.pmean((loss, db, ds), DATA)
    return loss, db, ds

  specs = {"blocks": P(STAGE), "shared": P()}

  def loss_and_grad(pipe, batch):
    bspec = jax.tree.map(lambda _: batch_spec(mesh, schedule), batch)
    bl_spec = jax.tree.map(lambda _: specs["blocks"], pipe["blocks"])
    sh_spec = jax.tree.map(lambda _: specs["shared"], pipe["shared"])
    fn = jax.shard_map(
      body, mesh=mesh, in_specs=(bl_spec, sh_spec, bspec), out_specs=(P(), bl_spec, sh_spec)
    )
    loss, db, ds = fn(pipe["blocks"], pipe["shared"], batch)
    cast = lambda d, p: d.astype(p.dtype)
    return loss, {
      "blocks": jax.tree.map(cast, db, pipe["blocks"]),
      "shared": jax.tree.map(cast, ds, pipe["shared"]),
    }

  return loss_and_grad
