r"""Workers as separate jobs that meet through object storage (``loco.transport=store:<url>``).

Under ``loco.transport=mesh`` the workers of a low-communication run are the ``replica`` axis of one
SPMD program and a sync is a collective (:mod:`acco_jax.loco.replica`). Under ``store:<url>`` each
worker is its own job (its own devices, a ``replica`` axis of one) and a sync is a *round* of a
:class:`acco_jax.loco.store.RoundStore`: every worker publishes its payload, the round's members
are the payloads that arrived by its deadline (recorded in the store), and every worker computes the
same aggregate from the members' payloads, in the order of their ids. This module is the step side
of a round: its programs (the payload, and the aggregate with the outer update), moving a payload
between the devices and the store, and the round's host logic.

.. code-block:: none

  encode      the payload of fragment p = r mod P (the method's, as the collective would take it):
              mean: compressed Δ; sparse: the top-k wire and the error feedback less it
              (a worker whose round was decided without it: the feedback before, in another
              program); pairs: [Δ | φ]                                 (one program per fragment)
  publish     its blocks (one per data rank) to round r, unless the round is decided
  members     wait for round r's decision (all live workers arrived, or grace_s after the first
              arrival with min_workers); a stop (SIGTERM) cuts the wait: the state goes back
              marked, and the next call (or a rerun from its checkpoint) finishes the sync
  aggregate   the members' payloads, then the outer update and merge as on the mesh; round r+1
              (one program per fragment and number of members)

A worker whose round was decided without it (it was slow, stalled or restarted) adopts the round:

==================  ========================================================================
DiLoCo, Streaming   its payload is dropped: it was measured against a ``θ_g`` that the round
DiLoCo              moved; it applies the round (and every later decided round: catching up)
                    and starts its next ``H`` steps from the new ``θ_g``
SparseLoCo, DeMo    nothing was sent, so nothing is lost: its error feedback (momentum) keeps
                    the whole accumulated buffer, sent in its next round
NoLoCo              there is no global ``θ_g``: it takes its outer step alone (its group is
                    itself) and publishes its next payload to the first undecided round
==================  ========================================================================

A worker that starts with rounds already decided (a joiner, or a founder that started late) catches
up the same way from its initial state, or, where the rounds it needs were collected, from the
latest *snapshot* (``θ_g`` and the outer optimizer's state, written by the first member of every
``loco.snapshot_every``-th round). With every worker present in every round the result is the SPMD
run's (the mean is taken in another order: equal to float tolerance).
"""

from __future__ import annotations

import atexit
import functools
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acco_jax import errors
from acco_jax.loco import base, programs
from acco_jax.loco import store as store_lib
from acco_jax.loco.noloco import matchings, pairing_index

PyTree = Any

SCHEME = "store:"


def store_url(transport: str) -> str | None:
  """The store's URL of ``loco.transport`` (``None`` for ``mesh``); a one-line error otherwise."""
  if transport == "mesh":
    return None
  if transport.startswith(SCHEME) and transport[len(SCHEME) :]:
    return transport[len(SCHEME) :]
  raise errors.UserValueError(
    f"loco.transport={transport!r}: choose 'mesh' (one SPMD program) or 'store:<url>' (workers as "
    "jobs meeting in a directory or bucket: store:/shared/run1, store:s3://bucket/run1)"
  )


class StoreTransport:
  """The rounds of one worker through a :class:`acco_jax.loco.store.RoundStore`.

  Args:
    store: the store, opened (its run checked, this worker's lease held).
    worker: this worker's id in ``[0, workers)``.
    workers: the run's worker slots ``M`` (its data shares; NoLoCo's matchings when all are there).
    snapshot_every: rounds between two snapshots of the global state.

  Attributes:
    stop: a callable, true once the run was asked to stop (a preemption), or None: a sync's wait
      for its round then gives up (:meth:`sync`). Set by :meth:`watch_stop`.
  """

  def __init__(self, store, worker: int, workers: int, snapshot_every: int):
    self.store, self.worker, self.workers = store, worker, workers
    self.snapshot_every, self.stop = snapshot_every, None
    self._looked = False  # whether resume() looked at the state for a sync cut short
    self._beat = threading.Event()
    threading.Thread(target=self._heartbeat, daemon=True).start()
    atexit.register(self.close)

  def _heartbeat(self):
    while not self._beat.wait(max(self.store.lease_s / 4, 0.05)):
      try:
        self.store.heartbeat()
      except Exception:  # a store that hiccups: the next beat tries again
        pass

  def watch_stop(self, requested) -> None:
    """From now on a sync's wait gives up once ``requested()`` is true (:meth:`sync`)."""
    self.stop = requested

  @property
  def held(self) -> bool:
    """Whether this worker still holds its id (not finished or closed)."""
    return not self._beat.is_set()

  def finish(self, state):
    """The run's last call is done: the others stop waiting for this worker from now on."""
    self._beat.set()
    self.store.finish(int(state.round) - 1)

  def close(self):
    """Stops the heartbeat and gives the worker's id back (a finished worker is not waited for)."""
    if not self._beat.is_set():
      self._beat.set()
      self.store.release()

  # -- the round of a sync -----------------------------------------------------------------------

  def sync(self, step, state, *, stoppable: bool = True):
    """A sync point (``τ = 0``): this worker's payload to its round, wait for the round's decision,
    apply it; a worker whose round was decided without it adopts the decided rounds instead.
    A round decided with it (a worker rerunning from its checkpoint) is applied as the first time.

    Where :attr:`stop` turns true during the wait (``stoppable``: not the run's last sync), the
    sync is *cut*: the state comes back as it was, marked (its round, ``inflight_fragment``) for
    :meth:`resume` to finish the sync at the next call, in this process or in a rerun from the
    checkpoint the trainer then saves; the round is left to the others, this worker's payload
    published. Returns ``(state, metrics)``."""
    r = self._round(step, state)
    p = r % step.method.fragments
    wire, kept, finite = encode_program(step, p)(state, jnp.int32(r))
    members = self.store.decided(r)
    if members is None and not self.store.collected(r):
      self.store.publish(r, host_blocks(wire))
      try:
        members = self.store.members(r, step.num_devices, stop=self.stop if stoppable else None)
      except store_lib.Stopped:
        self._looked = False  # the next call finishes this sync first
        cut = state._replace(round=jnp.int32(r), inflight_fragment=jnp.int32(p))
        return cut, {"outer_finite": finite}
    if members is not None and (self.worker in members or step.method.aggregate == "pairs"):
      own = wire if step.method.aggregate == "pairs" else None
      state, metrics = self.apply_round(step, state, r, members, own, kept)
      self.snapshot(step, state, r, members)
      return state, {**metrics, "outer_finite": finite}
    # late (or the round collected: away too long): nothing of this worker is in the round; the
    # error feedback keeps all it accumulated
    acc = accumulate_program(step, p)(state, jnp.int32(r)) if step.method.sparse else ()
    state, metrics = self.catch_up(step, state, acc)
    return state, {**metrics, "outer_finite": finite}

  def resume(self, step, state):
    """At a call's start: a sync :meth:`sync` cut short (the state marked so, maybe restored from
    a checkpoint) is finished first, without giving up again. Reads the state (a device read) only
    at this process's first call and the first after a cut; a method with windows (``τ > 0``)
    keeps ``inflight_fragment`` for :meth:`land`. Returns ``(state, metrics)``."""
    if self._looked or step.method.overlap_steps:
      return state, {}
    self._looked = True
    if int(state.inflight_fragment) < 0:
      return state, {}
    return self.sync(step, state, stoppable=False)

  def send(self, step, state):
    """The send point of a window (``τ > 0``): publish the payload, to be applied ``τ`` steps later
    (:meth:`land`); a late worker adopts the decided rounds instead and sends nothing. Returns
    ``(state, metrics)``."""
    r = self._round(step, state)
    p = r % step.method.fragments
    members = self.store.decided(r)
    if (members is not None and self.worker not in members) or self.store.collected(r):
      return self.catch_up(step, state)
    wire, _, finite = encode_program(step, p)(state, jnp.int32(r))
    if members is None:
      self.store.publish(r, host_blocks(wire))
    return state._replace(inflight_fragment=jnp.int32(p)), {"outer_finite": finite}

  def land(self, step, state):
    """The apply point of a window: wait for the round sent ``τ`` steps ago and apply it (nothing
    when this worker sent nothing)."""
    if int(state.inflight_fragment) < 0:
      return state, {}
    r = int(state.round)
    members = self.store.members(r, step.num_devices)
    state, metrics = self.apply_round(step, state, r, members, None, ())
    self.snapshot(step, state, r, members)
    return state, metrics

  def _round(self, step, state) -> int:
    """The round this worker publishes to: its next; NoLoCo's, where that was decided without it,
    the first undecided (it has no global state to catch up)."""
    r = int(state.round)
    if step.method.aggregate == "pairs":
      members = self.store.decided(r)
      if (members is not None and self.worker not in members) or self.store.collected(r):
        r = max(r, self.store.latest_decided() + 1)
    return r

  def catch_up(self, step, state, comp=()):
    """Applies the decided rounds that hold nothing of this worker's (it was late, stalled or away),
    up to the first undecided one or one it took part in (rerun from a checkpoint: its sync applies
    that one), reading a snapshot where the rounds were collected; ``comp``: its error feedback
    from now on, if it changed. Returns ``(state, the last round's metrics)`` with
    ``outer_caught_up``, the rounds applied. NoLoCo has no global state to catch up: nothing
    (its late worker steps alone, :meth:`apply_round`)."""
    if step.method.aggregate == "pairs":
      return state, {"outer_caught_up": jnp.int32(0)}
    count, metrics = 0, {}
    while True:
      r = int(state.round)
      members = self.store.decided(r)
      if members is None and self.store.collected(r):  # away too long: the latest snapshot
        state, count = self.resync(step, state, r), count + 1
        continue
      if members is None or self.worker in members:
        break
      try:
        state, metrics = self.apply_round(step, state, r, members, None, comp)
        comp = ()
      except store_lib.RoundGone:
        state = self.resync(step, state, r)
      count += 1
    if comp != ():
      state = state._replace(comp=comp)
    return state, {**metrics, "outer_caught_up": jnp.int32(count)}

  def resync(self, step, state, r: int):
    """``θ_g`` and the outer optimizer's state from the latest snapshot (this worker's local
    parameters replaced by them), for a round ``r`` that was collected before this worker read
    it."""
    s = self.store.latest_snapshot()
    if s is None or s <= r:
      raise errors.UserValueError(
        f"worker {self.worker} needs round {r} of {self.store.url}, which was collected, and no "
        f"later snapshot exists: raise loco.keep_rounds (now {self.store.keep_rounds}) or lower "
        f"loco.snapshot_every (now {self.snapshot_every})"
      )
    return self.adopt(step, state, s)

  def adopt(self, step, state, s: int):
    """The snapshot before round ``s``: its outer state, this worker's parameters replaced by its
    ``θ_g``, round ``s``."""
    outer = read_tree(self.store, s, state.outer, step.num_devices)
    return adopt_program(step)(state, outer, jnp.int32(s))

  def join(self, step, state):
    """A worker's first state: the rounds decided before it started, applied (a founder that
    started late) or, where they were collected, the latest snapshot and those after it. NoLoCo,
    whose workers each keep their own slow weights, starts from the latest snapshot's (its first
    member's ``φ`` and outer momentum) and pairs from the first undecided round."""
    if step.method.aggregate == "pairs":
      s = self.store.latest_snapshot()
      return state if s is None else self.adopt(step, state, s)
    return self.catch_up(step, state)[0]

  # -- aggregate ---------------------------------------------------------------------------------

  def apply_round(self, step, state, r: int, members: list, own_wire, comp):
    """Round ``r``'s aggregate of ``members``' payloads (read back from the store, this worker's
    too), the outer update and merge; ``own_wire``: NoLoCo's own payload, for a step alone;
    ``comp``: the error feedback after the round (``()``: unchanged)."""
    p = r % step.method.fragments
    if step.method.aggregate == "pairs":
      peer = self.peer(step, r, members)
      if peer == self.worker and own_wire is None:
        own_wire = encode_program(step, p)(state, jnp.int32(r))[0]
      wire = own_wire if peer == self.worker else self.read_wires(step, r, [peer])[0]
      return aggregate_program(step, p, 1)(state, wire, comp, jnp.int32(r))
    everyone = self.read_wires(step, r, members)
    fn = aggregate_program(step, p, len(members))
    return fn(state, everyone, comp, jnp.int32(r))

  def peer(self, step, r: int, members: list) -> int:
    """NoLoCo's peer of this worker in round ``r`` (itself when alone): the SPMD run's matching
    when every worker is a member, else a matching of the members drawn from the seed and
    ``r``."""
    pairing = step.method.pairing
    if self.worker not in members:
      return self.worker
    if len(members) == self.workers and self.workers % 2 == 0:
      table = matchings(self.workers, pairing.count, pairing.seed)
      which = int(pairing_index(pairing.seed, jnp.int32(r), pairing.count))
      return int(table[which, self.worker])
    order = np.random.default_rng([pairing.seed, r]).permutation(sorted(members))
    at = int(np.flatnonzero(order == self.worker)[0])
    if at == len(order) - 1 and len(order) % 2:
      return self.worker
    return int(order[at ^ 1])

  def read_wires(self, step, r: int, workers: list) -> jax.Array:
    """``[K, 1, D, n]``: the payloads of ``workers`` in round ``r`` (in that order), each device
    reading only its own data ranks."""
    spec = step.comm.spec
    sharding = NamedSharding(step.mesh, P(None, *spec))
    like = encode_shape(step, r % step.method.fragments)
    shape = (len(workers), *like.shape)
    cache: dict = {}

    def block(worker, rank):
      if (worker, rank) not in cache:
        cache[(worker, rank)] = self.store.read(r, worker, rank)
      return cache[(worker, rank)]

    def fill(index):
      ranks = range(step.num_devices)[index[2]]
      rows = [np.stack([block(w, d) for d in ranks])[None] for w in np.array(workers)[index[0]]]
      return np.stack(rows).astype(like.dtype)[..., index[3]]

    return jax.make_array_from_callback(shape, sharding, fill)

  # -- snapshots ---------------------------------------------------------------------------------

  def snapshot(self, step, state, r: int, members: list):
    """After round ``r``, by its first member: the global state before round ``r + 1`` (every
    ``snapshot_every`` rounds), and what the store no longer needs collected."""
    if self.worker != min(members) or (r + 1) % self.snapshot_every:
      return
    write_tree(self.store, r + 1, state.outer, step.num_devices)
    self.store.collect(r + 1)


# -- programs --------------------------------------------------------------------------------------


def encode_program(step, p: int):
  """``(state, r) -> (wire [1, D, n], kept, finite)`` of fragment ``p``: the payload as the
  collective would take it; for a sparse method ``kept``, the error feedback after sending (else
  ``()``). A worker whose payload no round took keeps :func:`accumulate_program`'s instead."""
  key = ("store_encode", p)
  if key not in step.programs:
    step.programs[key] = jax.jit(lambda state, r: _encode(step, p, state, r))
  return step.programs[key]


def encode_shape(step, p: int) -> jax.ShapeDtypeStruct:
  """The wire's shape and dtype for fragment ``p``."""
  key = ("store_wire_shape", p)
  if key not in step.programs:
    like = step.abstract_state(step.params_shapes)
    step.programs[key] = jax.eval_shape(encode_program(step, p), like, jnp.int32(0))[0]
  return step.programs[key]


def _encode(step, p: int, state, r):
  m, idx = step.method, step.parts[p]
  if m.aggregate == "mean":
    _, wire, finite = programs.mean_encode(step, state, p)
    return wire, (), finite
  if m.aggregate == "pairs":
    wire, finite = programs.pairs_encode(step, state, p)
    return wire, (), finite
  x, buffers = programs.payload(step, state, idx), base.select(state.comp, idx)
  keys = programs.fragment_keys(idx)
  specs = {k: step.comm.spec for k in keys}
  wire, kept = jax.shard_map(
    functools.partial(programs.sparse_encode, step, keys),
    mesh=step.mesh,
    in_specs=(specs, specs, P()),
    out_specs=(step.comm.spec, specs),
  )(x, buffers, r)
  return wire, base.replace(state.comp, kept), programs.finite_per_worker(x)


def accumulate_program(step, p: int):
  """``(state, r) -> comp``: a sparse worker's error feedback with its payload of round ``r``
  added and nothing taken out (``β e + c_r x``): what a worker keeps when no round took its
  payload. Compiled only where a worker was late, so a sync that takes part runs one program
  before its round."""
  key = ("store_accumulate", p)
  if key not in step.programs:

    def accumulated(state, r):
      idx = step.parts[p]
      x, buffers = programs.payload(step, state, idx), base.select(state.comp, idx)
      return base.replace(state.comp, programs.accumulate(step, x, buffers, r))

    step.programs[key] = jax.jit(accumulated)
  return step.programs[key]


def aggregate_program(step, p: int, count: int):
  """``(state, everyone, comp, r) -> (state, metrics)``: round ``r``'s outer update of fragment
  ``p`` from ``count`` payloads ``[count, 1, D, n]`` (pairs: the peer's ``[1, D, n]``)."""
  key = ("store_aggregate", p, count)
  if key not in step.programs:
    step.programs[key] = jax.jit(
      lambda state, everyone, comp, r: _aggregate(step, p, state, everyone, comp, r),
      donate_argnums=(0,),
    )
  return step.programs[key]


def _aggregate(step, p: int, state, everyone, comp, r):
  m, idx = step.method, step.parts[p]
  if m.aggregate == "mean":
    mean = programs.split(step, p, jnp.mean(everyone, axis=0))
  elif m.aggregate == "pairs":
    mean = programs.pairs_decode(step, state, p, everyone)
  else:
    mean = decode(step, idx, everyone)
    if comp != ():
      state = state._replace(comp=comp)
  state, outer = programs.apply_outer(step, state, p, mean)
  metrics = {**outer, "outer_members": jnp.int32(everyone.shape[0]), "outer_round": r}
  return state._replace(round=r + 1, inflight_fragment=jnp.int32(-1)), metrics


def decode(step, idx, everyone) -> dict:
  """The scatter-mean of the members' sparse wires, per device on its own rows."""
  keys, spec = programs.fragment_keys(idx), step.comm.spec
  return jax.shard_map(
    functools.partial(programs.sparse_decode, step, keys),
    mesh=step.mesh,
    in_specs=(P(None, *spec),),
    out_specs={k: spec for k in keys},
  )(everyone)


def adopt_program(step):
  """``(state, outer, r) -> state``: the outer state of a snapshot, this worker's parameters
  replaced by its ``θ_g``, round ``r``."""
  if "store_adopt" not in step.programs:

    def adopt(state, outer, r):
      state = state._replace(outer=outer, round=r, inflight_fragment=jnp.int32(-1))
      return programs.set_worker_params(step, state, outer.params)

    step.programs["store_adopt"] = jax.jit(adopt, donate_argnums=(0,))
  return step.programs["store_adopt"]


# -- between the devices and the store -------------------------------------------------------------


def host_blocks(x: jax.Array) -> dict[int, np.ndarray]:
  """This process's data-rank blocks of a ``[1, D, ...]`` array (``x[0, d]`` by rank ``d``)."""
  out = {}
  for shard in x.addressable_shards:
    start = shard.index[1].start or 0
    data = np.asarray(shard.data)
    for i in range(data.shape[1]):
      out.setdefault(start + i, data[0, i])
  return out


def write_tree(store, r: int, tree: PyTree, ranks: int) -> None:
  """A snapshot of ``tree`` (leaves ``[1, D, ...]`` or ``[1]``) at round ``r``, one object per data
  rank this process holds."""
  leaves = jax.tree.leaves(tree)
  by_rank: dict = {}
  for i, leaf in enumerate(leaves):
    if leaf.ndim >= 2:
      for d, block in host_blocks(leaf).items():
        by_rank.setdefault(d, {})[f"{i:04d}"] = block
    else:
      whole = np.asarray(jax.device_get(leaf))[0]
      for d in range(ranks):
        by_rank.setdefault(d, {})[f"{i:04d}"] = whole
  for d, arrays in sorted(by_rank.items()):
    store.write_snapshot(r, d, arrays)
  if jax.process_index() == 0:
    store.finish_snapshot(r)


def read_tree(store, r: int, like: PyTree, ranks: int) -> PyTree:
  """The snapshot of round ``r`` as arrays placed like ``like``'s leaves."""
  blocks = [store.read_snapshot(r, d) for d in range(ranks)]
  leaves, treedef = jax.tree.flatten(like)
  out = []
  for i, leaf in enumerate(leaves):
    key = f"{i:04d}"
    if leaf.ndim >= 2:
      whole = np.stack([b[key] for b in blocks])[None]
    else:
      whole = blocks[0][key][None]
    whole = whole.astype(leaf.dtype)
    out.append(jax.make_array_from_callback(whole.shape, leaf.sharding, lambda i, w=whole: w[i]))
  return jax.tree.unflatten(treedef, out)


class Offline(NamedTuple):
  """A store worker's id and slots for a step that never syncs: one that reads the worker's
  checkpoints (an export)."""

  worker: int
  workers: int

  def join(self, step, state):
    return state

  def watch_stop(self, requested) -> None:
    pass
