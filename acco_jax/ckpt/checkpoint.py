"""Atomic, asynchronous, self-checking checkpoints of a sharded train state (orbax).

:class:`Checkpointer` saves any pytree of ``jax.Array`` (normally a :class:`acco_jax.dp.step.TrainState`)
together with a JSON-able ``extra`` dict (data-iterator position, RNG, config, metrics). ``None`` fields
(``buf``/``buf_count`` of synchronous methods) are empty subtrees: they are not stored and come back as
``None`` from the target's tree structure. On disk, one directory per step:

.. code-block:: none

  DIR/
    <step>/                       written as <step>.orbax-checkpoint-tmp, renamed when complete
      _CHECKPOINT_METADATA        orbax's step metadata
      state/                      orbax StandardSave (OCDBT + zarr): one entry per group of
                                  packed leaves, "pack<n>_<dtype>", and per leaf stored alone,
                                  "<index>_<path>", e.g. "003_params_out_bias" (pack.py)
      meta/metadata               JSON: {"version", "leaves": [{path, key, shape, dtype, fingerprint,
                                  pack: [group, column, columns, rows, width] if packed}], "extra"}

Each leaf's ``fingerprint`` (:mod:`acco_jax.ckpt.fingerprint`) is a position-sensitive 32-bit hash of
its bits, computed on device (a global reduction, so every process agrees) at save time and
recomputed after a restore: a checkpoint whose files are missing, truncated or garbled fails either
in orbax/TensorStore or at this check, since a flipped byte in a compressed chunk can decode without
error into wrong numbers. ``restore(None, ...)`` then falls back to the newest checkpoint that
passes. Steps appear in :meth:`latest_step` only once finalized (renamed), so a save killed half-way
leaves an ignored ``*.orbax-checkpoint-tmp`` directory (replaced if that step is saved again; not
swept at start-up, so that a reader such as an evaluator can never delete a writer's save in
progress).

A checkpoint written on another device count (leaf shapes that differ only by ``N``) is restored by
``restore(..., reshard=fn)``: the arrays are read into host memory with their saved shapes, checked
against their fingerprints, converted by ``fn`` (e.g. :meth:`acco_jax.dp.step.TrainStep.reshard`, see
:mod:`acco_jax.dp.reshard`) and placed with the target's shardings.

Orbax coordinates processes itself (the primary host writes metadata and renames); every process must
call :meth:`Checkpointer.save` and :meth:`Checkpointer.restore` with its part of the global arrays.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint.path import step as step_lib

from acco_jax import errors
from acco_jax.ckpt import fingerprint, settling
from acco_jax.ckpt import leaves as leaves_lib
from acco_jax.ckpt import pack as pack_lib

PyTree = Any
_VERSION = 2  # 2: leaves packed into groups (pack.py); 1: every leaf alone, still read
_log = logging.getLogger(__name__)


class _Corrupt(Exception):
  """A checkpoint step that cannot be read back intact."""


def _all_processes_agree(ok: bool) -> bool:
  """True iff ``ok`` on every process (so all take the same fallback branch)."""
  if jax.process_count() == 1:
    return ok
  with jax.transfer_guard("allow"):
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def open_read_only(directory: str) -> Checkpointer:
  """A read-only :class:`Checkpointer` on another run's checkpoints (``ckpt.init_from``, the
  export), without orbax's two warnings that it is read-only."""
  log = logging.getLogger("absl")
  level = log.level
  log.setLevel(logging.ERROR)
  try:
    return Checkpointer(directory, read_only=True, async_save=False)
  finally:
    log.setLevel(level)


class Checkpointer:
  """Saves and restores ``(state, extra)`` under ``directory``, one subdirectory per step.

  Args:
    directory: local path or URL (``gs://...``); created if missing. Relative paths are made absolute.
    keep: how many of the newest checkpoints to keep (older ones are deleted after a newer save is
      complete); ``None`` keeps all.
    async_save: write in a background thread; :meth:`save` returns once the arrays are copied to host.
    read_only: only read (another run's checkpoints, ``ckpt.init_from``): nothing is created,
      saved or deleted in ``directory``.
  """

  def __init__(
    self, directory: str, *, keep: int | None = 3, async_save: bool = True, read_only=False
  ):
    directory = str(directory)
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    if keep is not None and keep < 1:
      raise errors.UserValueError(f"keep must be >= 1 or None, got {keep}")
    options = ocp.CheckpointManagerOptions(
      max_to_keep=None if read_only else keep,
      enable_async_checkpointing=async_save,
      read_only=read_only,
      create=not read_only,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    # JAX's preemption sync point is the trainer's (monitor.Preemption): orbax also reports its
    # steps there (only to log them), from its finalize thread at any time, which can split the stop
    self._manager.reached_preemption = lambda step: False
    self._bad: set[int] = set()  # steps this object found corrupt (may be replaced by a save)
    self._last_saved: int | None = None

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- queries ------------------------------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Steps of the complete (finalized) checkpoints, ascending; a save in flight is not included."""
    root = self._manager.directory
    return sorted(s for s in self._manager.all_steps() if step_lib.is_path_finalized(root / str(s)))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint step (not one :meth:`restore` found corrupt), or ``None``."""
    steps = [s for s in self.all_steps() if s not in self._bad]
    return steps[-1] if steps else None

  # -- save ---------------------------------------------------------------------------------------

  def save(self, step: int, state: PyTree, *, extra: dict) -> None:
    """Starts saving ``state`` and ``extra`` as ``step`` (waits for the previous save first).

    Args:
      step: a non-negative int, larger than every step already in the directory.
      state: a pytree of ``jax.Array``; ``None`` fields are allowed (not stored).
      extra: a JSON-serialisable dict, returned as is by :meth:`restore`.

    Saving again the step this object saved last is a no-op (e.g. a final save right after a
    periodic one that is still in flight, so not yet in :meth:`latest_step`).

    Raises:
      ValueError: the directory already holds a checkpoint at ``step`` or later (orbax would silently
        skip the save), except ones :meth:`restore` found corrupt: those are deleted first.
      TypeError: a leaf is not a ``jax.Array`` or ``extra`` is not JSON-serialisable.
    """
    step = int(step)
    self._manager.wait_until_finished()
    if step == self._last_saved and step in self._manager.all_steps():
      return
    paths, leaves = leaves_lib.flatten(state, "state")
    bad_type = [p for p, x in zip(paths, leaves, strict=True) if not isinstance(x, jax.Array)]
    if bad_type:
      raise TypeError(f"checkpoint state leaves must be jax.Arrays; {bad_type[0]} is not")
    try:  # fail here, not in the writer thread
      extra = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
      raise TypeError(f"checkpoint extra must be JSON-serialisable: {e}") from None
    for s in sorted(s for s in self._bad.intersection(self._manager.all_steps()) if s >= step):
      _log.warning(
        "deleting corrupt checkpoint step %d in %s to save step %d", s, self.directory, step
      )
      self._manager.delete(s)
      self._bad.discard(s)
    later = [s for s in self._manager.all_steps() if s >= step]
    if later:
      raise ValueError(
        f"cannot save step {step} in {self.directory}: it already holds step(s) {later} >= {step}; "
        "resume from the latest step, delete those, or use a new directory"
      )
    keys = [f"{i:03d}_{re.sub(r'[^A-Za-z0-9]+', '_', p).strip('_')}" for i, p in enumerate(paths)]
    entries = [
      {"path": p, "key": k, "shape": list(x.shape), "dtype": x.dtype.name, "fingerprint": f}
      for p, k, x, f in zip(paths, keys, leaves, fingerprint.fingerprints(leaves), strict=True)
    ]
    groups, alone = pack_lib.plan(leaves)
    items = {keys[i]: leaves[i] for i in alone}
    for g in groups:
      items[g.key] = pack_lib.pack(g, leaves)
      for i, column, columns in g.members:  # its columns of the group's (rows, width) array
        entries[i]["pack"] = [g.key, column, columns, g.rows, g.width]
    meta = {"version": _VERSION, "leaves": entries, "extra": extra}
    args = ocp.args.Composite(state=ocp.args.StandardSave(items), meta=ocp.args.JsonSave(meta))
    with jax.transfer_guard("allow"):
      if not self._manager.save(step, args=args):
        raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")
    self._last_saved = step

  def wait(self) -> None:
    """Blocks until every pending save is complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases orbax's resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  # -- restore ------------------------------------------------------------------------------------

  def restore(
    self,
    step: int | None,
    target: PyTree,
    *,
    reshard: Callable[[PyTree], PyTree] | None = None,
    check_extra: Callable[[dict], None] | None = None,
    saved_like: Callable[[dict], PyTree | None] | None = None,
  ) -> tuple[PyTree, dict]:
    """Reads a checkpoint into arrays with the target's tree structure, shardings and dtypes.

    Args:
      step: the step to read, or ``None`` for the newest one that reads back intact (corrupt newer
        steps are skipped with a warning).
      target: a pytree of ``jax.Array`` or ``jax.ShapeDtypeStruct`` with ``sharding`` set, e.g. a
        freshly initialised state or its ``jax.eval_shape`` plus shardings.
      reshard: used when the checkpoint has the target's leaves but other shapes (it was written on
        another device count): called with the saved arrays as host numpy arrays in the target's
        tree structure, it returns numpy arrays of the target's shapes, e.g.
        :meth:`acco_jax.dp.step.TrainStep.reshard`. Without it, other shapes are a ``ValueError``.
      check_extra: called with the checkpoint's ``extra`` before any array is read or compared;
        it raises to refuse the checkpoint (e.g. a model-config mismatch with a clearer message
        than the shapes would give).
      saved_like: with ``reshard``, for a checkpoint whose leaf paths differ from the target's
        (the owner layout on another device count has other slots): called with the saved
        shapes by path, it returns the saved state's structure (or ``None``: a mismatch), in which
        ``reshard`` then receives the arrays, e.g. :meth:`acco_jax.dp.step.TrainStep.saved_like`.

    Returns:
      ``(state, extra)``.

    Raises:
      FileNotFoundError: no checkpoint (at ``step``) in the directory.
      ValueError: the checkpoint was written for a different state (tree paths or shapes differ,
        or ``reshard`` rejects it).
      RuntimeError: the requested step, or every step when ``step`` is ``None``, is corrupt.
    """
    return self._first_readable(
      step, lambda s: self._restore_step(s, target, reshard, check_extra, saved_like)
    )

  def restore_host(
    self,
    step: int | None,
    target_of: Callable[[dict], PyTree],
    saved_like: Callable[[dict], PyTree | None] | None = None,
  ):
    """``(state, extra)``, ``state`` as host numpy arrays with the shapes they were written with.

    For a state whose structure only the checkpoint's ``extra`` tells (another run's,
    ``ckpt.init_from``): ``target_of(extra)`` returns a pytree of that structure (its leaves'
    shapes do not matter), or raises to refuse the checkpoint. Where the saved leaf paths differ
    from the target's (the owner layout on another device count), ``saved_like`` (called after
    ``target_of``) gives the saved structure from the saved shapes, as for :meth:`restore`.
    Fingerprints and the fall-back to older steps are :meth:`restore`'s."""
    return self._first_readable(step, lambda s: self._host_step(s, target_of, saved_like))

  def _first_readable(self, step: int | None, read: Callable[[int], Any]):
    """``read(step)``, or with ``step=None`` ``read`` of the newest step that reads back intact."""
    self._manager.wait_until_finished()
    steps = self.all_steps()
    if step is not None:
      if int(step) not in steps:
        raise errors.UserFileNotFoundError(
          f"no checkpoint at step {step} in {self.directory}; found {steps}"
        )
      try:
        return read(int(step))
      except _Corrupt as e:
        raise errors.UserRuntimeError(
          f"checkpoint step {step} in {self.directory} is corrupt: {e}"
        ) from None
    if not steps:
      raise errors.UserFileNotFoundError(f"no checkpoint in {self.directory}")
    for s in reversed(steps):
      try:
        return read(s)
      except _Corrupt as e:
        _log.warning(
          "checkpoint step %d in %s is corrupt, trying an older one: %s", s, self.directory, e
        )
    raise errors.UserRuntimeError(
      f"no readable checkpoint in {self.directory}: steps {steps} are all corrupt"
    )

  def _read(self, step: int, what: str, fn):
    """Returns ``fn()``; if it fails on any process, marks ``step`` corrupt and raises ``_Corrupt``."""
    try:
      with jax.transfer_guard("allow"):
        result, reason = fn(), ""
    except Exception as e:  # orbax/TensorStore raise many types on damaged files
      result, reason = None, " ".join(str(e).split())[:200] or type(e).__name__
    if not _all_processes_agree(not reason):
      self._bad.add(step)
      raise _Corrupt(f"{what}: {reason or 'unreadable on another process'}")
    return result

  def _orbax_restore(self, step: int, **items):
    """Orbax's restore of ``items`` at ``step``; a read that fails leaves no reads behind."""
    with settling.settled_loops():
      return self._manager.restore(step, args=ocp.args.Composite(**items))

  def _read_meta(self, step: int) -> tuple[dict, dict]:
    meta = self._orbax_restore(step, meta=ocp.args.JsonRestore()).meta
    if meta["version"] not in (1, _VERSION) or not isinstance(meta["extra"], dict):
      raise ValueError(f"unknown metadata version {meta['version']}")
    saved = {e["path"]: e for e in meta["leaves"]}
    for e in saved.values():  # malformed entries count as corruption, not as a mismatch
      e.update(shape=tuple(map(int, e["shape"])), dtype=jnp.dtype(e["dtype"]), key=str(e["key"]))
      if "pack" in e:  # version 1 stored every leaf alone
        e["pack"] = [str(e["pack"][0]), *map(int, e["pack"][1:5])]
    return saved, meta["extra"]

  def _restore_step(
    self, step: int, target: PyTree, reshard=None, check_extra=None, saved_like=None
  ) -> tuple[PyTree, dict]:
    paths, leaves = leaves_lib.flatten(target, "target")
    saved, extra = self._read(step, "metadata", lambda: self._read_meta(step))
    if check_extra is not None:
      check_extra(extra)
    like = None
    if reshard is not None and saved_like is not None and set(saved) != set(paths):
      like = saved_like({p: e["shape"] for p, e in saved.items()})
    if like is not None:  # another structure that reshard converts (other slots)
      like_paths = leaves_lib.flatten(like, "saved structure")[0]
      if set(like_paths) == set(saved):
        entries = [saved[p] for p in like_paths]
        treedef = jax.tree.structure(like)
        return self._restore_resharded(step, target, entries, reshard, treedef), extra
    convert = (
      reshard is not None
      and set(saved) == set(paths)
      and any(saved[p]["shape"] != tuple(x.shape) for p, x in zip(paths, leaves, strict=True))
    )
    leaves_lib.check_matches(self.directory, step, saved, paths, leaves, not convert)
    for p, x in zip(paths, leaves, strict=True):
      if getattr(x, "sharding", None) is None:
        raise ValueError(f"restore target leaf {p} has no sharding; pass arrays or sharded structs")
    entries = [saved[p] for p in paths]
    if convert:
      return self._restore_resharded(step, target, entries, reshard), extra
    abstract = pack_lib.items_to_read(entries, leaves)

    def read_arrays():
      arrays = self._orbax_restore(step, state=ocp.args.StandardRestore(abstract)).state
      restored = pack_lib.assemble(arrays, entries, leaves)
      got = fingerprint.fingerprints(restored)
      bad = [e["path"] for e, f in zip(entries, got, strict=True) if f != e["fingerprint"]]
      if bad:
        raise ValueError(f"{bad[0]} does not match its fingerprint ({len(bad)} leaves differ)")
      return restored

    restored = self._read(step, "arrays", read_arrays)
    cast = lambda r, x: jax.jit(lambda a: a.astype(x.dtype), out_shardings=x.sharding)(r)
    out = [r if r.dtype == x.dtype else cast(r, x) for r, x in zip(restored, leaves, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(target), out), extra

  def _host_step(self, step: int, target_of, saved_like=None) -> tuple[PyTree, dict]:
    saved, extra = self._read(step, "metadata", lambda: self._read_meta(step))
    target = target_of(extra)
    paths, leaves = leaves_lib.flatten(target, "target")
    if saved_like is not None and set(saved) != set(paths):
      like = saved_like({p: e["shape"] for p, e in saved.items()})
      if like is not None:
        target = like
        paths, leaves = leaves_lib.flatten(target, "saved structure")
    leaves_lib.check_matches(self.directory, step, saved, paths, leaves, shapes=False)
    entries = [saved[p] for p in paths]
    restored = self._read(step, "arrays", lambda: self._read_host(step, entries))
    return jax.tree.unflatten(jax.tree.structure(target), restored), extra

  def _read_host(self, step: int, entries: list[dict]) -> list[np.ndarray]:
    """The arrays of ``entries`` as numpy with their saved shapes, checked against fingerprints."""
    abstract = pack_lib.items_to_read(entries)
    arrays = self._orbax_restore(step, state=ocp.args.StandardRestore(abstract)).state
    restored = [np.asarray(a) for a in pack_lib.assemble(arrays, entries)]
    got = [fingerprint.hash_host(x) for x in restored]
    bad = [e["path"] for e, f in zip(entries, got, strict=True) if f != e["fingerprint"]]
    if bad:
      raise ValueError(f"{bad[0]} does not match its fingerprint ({len(bad)} leaves differ)")
    return restored

  def _restore_resharded(
    self, step: int, target: PyTree, entries: list[dict], reshard, saved_treedef=None
  ) -> PyTree:
    """Reads host arrays, converts them with ``reshard`` and places them like the target
    (``saved_treedef``: the saved state's structure, default the target's)."""
    restored = self._read(step, "arrays", lambda: self._read_host(step, entries))
    treedef = jax.tree.structure(target)
    try:
      converted = reshard(jax.tree.unflatten(saved_treedef or treedef, restored))
    except ValueError as e:
      raise errors.UserValueError(
        f"cannot restore the checkpoint at {self.directory} (step {step}) on this device count: {e}"
      ) from None
    leaves, got = jax.tree.leaves(target), jax.tree.leaves(converted)
    if jax.tree.structure(converted) != treedef or any(
      np.shape(a) != tuple(x.shape) for a, x in zip(got, leaves, strict=True)
    ):
      raise ValueError(f"reshard returned arrays not shaped like the target (step {step})")
    _log.info("resharded checkpoint step %d in %s to the target's shapes", step, self.directory)

    place = lambda a, x: pack_lib.place(np.asarray(a).astype(x.dtype, copy=False), x.sharding)
    with jax.transfer_guard("allow"):
      return jax.tree.unflatten(treedef, [place(a, x) for a, x in zip(got, leaves, strict=True)])
