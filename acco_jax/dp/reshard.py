"""Elastic restore: a train state saved on ``N_old`` devices, converted on the host for ``N_new``.

:meth:`acco_jax.ckpt.checkpoint.Checkpointer.restore` reads a checkpoint whose leaf shapes differ from the
target's as host numpy arrays and hands them to a ``reshard`` callable, normally
:meth:`acco_jax.dp.step.TrainStep.reshard`, which calls :func:`reshard_state` here. What depends on ``N``
(:class:`acco_jax.dp.step.TrainState`, :mod:`acco_jax.dp.flat`):

- ``w``, the flat ``[N*S]`` compute weights: :func:`acco_jax.dp.flat.reshard_flat`, bit-identical.
- ``params`` and every optimizer-state leaf shaped like a parameter (Adam's moments, the committed
  copy of ACCO and WP), ``[N, s_l]`` chunks: :func:`acco_jax.dp.flat.reshard_chunks`, bit-identical.
  Which state leaves those are is found by running the optimizer's ``init`` on a tagged shards tree
  (parameter ``l`` shaped ``(1, TAG + l)``: :func:`probe_tags`), so any elementwise optax chain works.
- ``buf`` ``[N, N*S]`` and ``buf_count`` ``[N]`` (delayed methods), per-device gradient sums and
  microbatch counts: the step only ever uses their sums over devices.
  :meth:`acco_jax.dp.stage.StageProgram.reduce` reduce-scatters (or psums) the rows and psums the
  counts; the microbatch loops add a device's new gradients and count to its own row when ACCO
  keeps the accumulator, which keeps the sums; counts are never used one device at a time (a
  stage counts as empty only when the *total* is zero). So old row ``i`` moves, converted leaf by
  leaf, into new row ``i * N_new // N_old``: when growing, each old row lands in
  a row of its own, bit for bit, and the other rows and counts are zero; when shrinking, groups of
  consecutive rows are summed in float32 and stored in the buffer's dtype. The reduced mean
  gradient is the same up to float summation order, plus, when shrinking a bfloat16 buffer, one
  rounding of each merged row to bfloat16 (as a reduction in that dtype rounds partial sums).
- ``residual`` ``[N, N*S]`` (ZeRO-1 with quantized gradients and error feedback): what each device's
  last quantized send did not deliver. Like ``buf``, only its sum over devices matters (it joins the
  next sends), so it carries over by the same rule: rows move or merge, sums kept. ACCO's residual
  lives in ``buf`` and carries over with it; the compute weights' is ``θ - w``, kept bit for bit.
- scalars (stage counters, optimizer step counts, injected hyperparameters): unchanged.

Nothing has to divide: every ``N >= 1`` has its own padding. A checkpoint of another model or
optimizer (other parameter shapes, other state) is a one-line ``ValueError``.

The data position is :func:`acco_jax.data.pipeline.data_state`. Everything runs on numpy on every
process (the whole state in host memory): fine for the models here, not for a multi-host restore of
a very large model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax.dp.flat import FlatLayout, reshard_chunks, reshard_flat

PyTree = Any
TAG = 1_000_003  # a size no real leaf has: leaf t of a probe tree ends in a dimension TAG + t


def probe_tags(init, tree_like, ndim=lambda x: x.ndim) -> tuple[list, list]:
  """What each leaf of an optimizer's state holds, found by running ``init`` abstractly on a probe
  of ``tree_like`` whose leaf ``t`` is shaped ``(1, ..., 1, TAG + t)`` with ``ndim(x)`` dimensions.

  Returns:
    ``(tags, prefixes)``, per leaf of the state: the leaf of ``tree_like`` it is shaped like (or
    ``None``), and the path of the subtree it belongs to (the state's path without the leaf's own
    path in ``tree_like``: a momentum, a second moment; ``None`` when untagged).
  """
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree_like)[0]]
  probe = jax.tree.structure(tree_like).unflatten(
    [
      jax.ShapeDtypeStruct((1,) * (ndim(x) - 1) + (TAG + t,), jnp.float32)
      for t, x in enumerate(jax.tree.leaves(tree_like))
    ]
  )
  tags, prefixes = [], []
  for path, x in jax.tree_util.tree_flatten_with_path(jax.eval_shape(init, probe))[0]:
    t = x.shape[-1] - TAG if x.ndim and all(d == 1 for d in x.shape[:-1]) else -1
    t = t if 0 <= t < len(paths) else None
    tags.append(t)
    prefixes.append(None if t is None else jax.tree_util.keystr(path[: len(path) - len(paths[t])]))
  return tags, prefixes


def saved_num_devices(saved) -> int:
  """``N`` of a saved state (a ``TrainState`` of host arrays): the leading dim of its shards."""
  return int(np.shape(jax.tree.leaves(saved.params)[0])[0])


def _state_shapes(layout: FlatLayout, tx, delayed: bool, residual: bool) -> list[tuple[int, ...]]:
  """Shapes of the leaves of a ``TrainState`` for ``layout``, in flattening order."""
  n, padded = layout.num_shards, layout.padded_size
  opt = jax.eval_shape(tx.init, layout.shard_shapes())
  shapes = [(padded,), *[(n, s.chunk) for s in layout.specs]]
  shapes += [tuple(x.shape) for x in jax.tree.leaves(opt)]
  shapes += ([(n, padded), (n,)] if delayed else []) + [()]
  return shapes + ([(n, padded)] if residual else [])


def _param_index(tx, layout: FlatLayout) -> list[int | None]:
  """For each leaf of ``tx``'s state: the parameter leaf it is shaped like, or ``None`` (the
  flat layout's leaves are ``[N, chunk]``)."""
  like = [jax.ShapeDtypeStruct((1, 1), jnp.float32)] * len(layout.specs)
  return probe_tags(tx.init, layout.treedef.unflatten(like))[0]


def merge_rows(buf: np.ndarray, count: np.ndarray, num_new: int, padded_new: int, convert):
  """Per-device buffers ``[N_old, N_old*S]`` and counts -> ``[N_new, N_new*S']``, same sums;
  ``convert`` moves one device's flat buffer to the new layout."""
  acc_dtype = np.promote_types(buf.dtype, np.float32)
  rows = np.zeros((num_new, padded_new), acc_dtype)
  counts = np.zeros((num_new,), count.dtype)
  filled = np.zeros((num_new,), bool)
  for i in range(buf.shape[0]):
    j = i * num_new // buf.shape[0]
    row = np.asarray(convert(buf[i])).astype(acc_dtype)
    if filled[j]:
      rows[j] += row
    else:  # assigned, not added to zero: keeps -0.0 and every bit when rows do not merge
      rows[j], filled[j] = row, True
    counts[j] += count[i]
  return rows.astype(buf.dtype), counts


def reshard_state(saved, layout: FlatLayout, tx):
  """A ``TrainState`` of host arrays saved on any ``N`` -> the same state for ``layout``'s ``N``.

  Args:
    saved: the state as read from a checkpoint (numpy leaves, the saved shapes).
    layout: the target :class:`FlatLayout` (its ``num_shards`` is the new ``N``).
    tx: the method transform the state belongs to (its ``init`` says which state leaves are
      parameter-shaped).

  Returns:
    The state with numpy leaves shaped for ``layout`` (same dtypes); see the module docstring for
    what is exact.

  Raises:
    ValueError: the saved state is not this model's and optimizer's on any device count.
  """
  n_old = saved_num_devices(saved)
  old = layout.resized(n_old)
  delayed = saved.buf is not None
  flat = jax.tree_util.tree_flatten_with_path(saved)[0]
  residual = getattr(saved, "residual", None) is not None
  expected = _state_shapes(old, tx, delayed, residual)
  if len(flat) != len(expected):
    raise ValueError(f"it holds {len(flat)} arrays, but this state has {len(expected)}")
  for (path, x), want in zip(flat, expected, strict=True):
    if tuple(np.shape(x)) != want:
      raise ValueError(
        f"it holds another model or optimizer: {jax.tree_util.keystr(path)} is "
        f"{list(np.shape(x))}, but {list(want)} for this one on {n_old} devices; resume with the "
        "config it was written with, or start in a new directory"
      )
  opt_old = jax.tree_util.tree_flatten_with_path(saved.opt_state)[0]
  opt_new = jax.tree.leaves(jax.eval_shape(tx.init, layout.shard_shapes()))
  opt = []
  for (path, x), i, want in zip(opt_old, _param_index(tx, old), opt_new, strict=True):
    if i is not None:
      opt.append(reshard_chunks(x, old, layout, i))
    elif np.shape(x) == want.shape:
      opt.append(np.asarray(x))
    else:
      raise ValueError(
        f"optimizer state leaf opt_state{jax.tree_util.keystr(path)} depends on the device count "
        "but is not shaped like a parameter, so it cannot be resharded; resume on "
        f"{n_old} devices"
      )
  params = [reshard_chunks(x, old, layout, i) for i, x in enumerate(jax.tree.leaves(saved.params))]
  out = saved._replace(
    w=reshard_flat(saved.w, old, layout),
    params=layout.treedef.unflatten(params),
    opt_state=jax.tree.unflatten(jax.tree.structure(saved.opt_state), opt),
  )
  convert = lambda row: reshard_flat(row, old, layout)
  if delayed:
    buf, count = merge_rows(
      np.asarray(saved.buf),
      np.asarray(saved.buf_count),
      layout.num_shards,
      layout.padded_size,
      convert,
    )
    out = out._replace(buf=buf, buf_count=count)
  if residual:
    rest = np.asarray(saved.residual)
    zero = np.zeros(rest.shape[:1], np.int32)
    rest, _ = merge_rows(rest, zero, layout.num_shards, layout.padded_size, convert)
    out = out._replace(residual=rest)
  return out
