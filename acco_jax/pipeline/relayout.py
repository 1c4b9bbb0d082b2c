"""A pipeline train state to and from the portable form (``ckpt.init_from`` across run kinds).

:class:`acco_jax.pipeline.step.PipelineStep` and :func:`source_step` call these; the form and
the contract are :mod:`acco_jax.ckpt.portable`'s. What each part of a
:class:`~acco_jax.pipeline.step.PipeState` becomes:

- ``params`` and every parameter-shaped subtree of the inner optimizer's state, ``{g: [S, P_g]}``
  buffers (:mod:`acco_jax.pipeline.packing`): unpacked to the model's structure (each stage's blocks
  and stage 0's embedding and head cut out of the buffers, padding dropped) and packed back for
  this run's stages, split and lanes, bit for bit. Any split unpacks: the offsets depend on the
  blocks per stage, not on the lanes' padding.
- ``pipeline.data_method=acco`` (:class:`~acco_jax.dp.methods.AccoState`): the form carries the
  committed θ and the inner state S, as for the data-parallel ACCO (:mod:`acco_jax.dp.relayout`):
  the estimate θ̃ of a round in progress and the flushes' gradients in the buffer are dropped.
  Import into ``acco`` starts a fresh cycle: the compute weights are θ, the buffer is empty and the
  first flush fills it at θ (as a new pipeline-ACCO run starts), then estimates and commits
  alternate. The cost: the dropped flushes' tokens (the data position, kept, stays after them) and
  one filling flush.
- The stage counter is the trainer's: the first stage of the source's update count.

A scheduled SkipPipe plan stays with its mesh (:mod:`acco_jax.run.init_from` refuses it onto
another); the plan a pipeline target trains is its own.
"""

from __future__ import annotations

import jax
import numpy as np

from acco_jax.ckpt.portable import PortableState, check_fits, map_param_subtrees, place
from acco_jax.dp.methods import AccoState


def _updates(data_method: str, stage: int) -> int:
  """Updates after ``stage`` flushes (:func:`acco_jax.pipeline.build.updates_done`)."""
  return max(stage - 1, 0) // 2 if data_method == "acco" else stage


def _check(packing) -> None:
  if packing.matrix_slots:
    raise ValueError(
      "a pipeline run with opt.name=muon keeps its optimizer state per stacked matrix; it cannot "
      "be carried to another run kind yet: resume it in its own workdir"
    )


def export_state(packing, data_method: str, saved) -> PortableState:
  """``saved`` (host numpy, as written) -> :class:`PortableState` (see the module)."""
  _check(packing)
  opt = saved.opt_state
  acco = isinstance(opt, AccoState)
  theta = opt.committed if acco else saved.params
  inner = opt.inner_state if acco else opt
  unpack = lambda sub: packing.unpack({g: np.asarray(v) for g, v in sub.items()})
  stage = int(np.asarray(saved.stage))
  dropped = []
  if acco and int(np.asarray(opt.stage)) % 2:
    dropped.append("the estimate of the round in progress")
  if saved.buf_count is not None and int(np.asarray(saved.buf_count)):
    dropped.append(f"{int(np.asarray(saved.buf_count))} flushes' gradients in flight")
  return PortableState(
    params=jax.tree.map(lambda x: x.astype(np.float32), unpack(theta)),
    opt=map_param_subtrees(unpack, inner, saved.params),
    updates=_updates(data_method, stage),
    source=f"pipeline-{data_method}",
    dropped=", ".join(dropped),
  )


def import_state(step, portable: PortableState, stage: int):
  """:class:`PortableState` -> ``step``'s state, placed, at stage ``stage`` (see the module)."""
  _check(step.packing)
  like = step.params_like
  abstract = step.abstract_state(like)
  acco = isinstance(abstract.opt_state, AccoState)
  inner_like = abstract.opt_state.inner_state if acco else abstract.opt_state
  check_fits(portable, like, map_param_subtrees(lambda _: like, inner_like, abstract.params))
  pack = step.packing.pack
  theta = pack(jax.tree.map(np.asarray, portable.params))
  inner = map_param_subtrees(pack, portable.opt, like)
  host = abstract._replace(params=theta, opt_state=inner, stage=np.asarray(stage, np.int32))
  if acco:  # a fresh cycle at θ: ACCO's own counter even (an estimate next), an empty buffer
    updates = 2 * _updates("acco", stage)
    zeros = lambda x: np.zeros(x.shape, x.dtype)
    host = host._replace(
      opt_state=AccoState(inner, theta, np.asarray(updates, np.int32)),
      w=jax.tree.map(lambda x, w: x.astype(w.dtype), theta, abstract.w),
      buf=jax.tree.map(zeros, abstract.buf),
      buf_count=zeros(abstract.buf_count),
    )
  return place(host, abstract)


class SourceStep:
  """A pipeline run's step as ``ckpt.init_from`` reads it: its state's structure and its export,
  with no mesh (the source may have had more devices than this run)."""

  def __init__(self, packing, tx, data_method: str, build):
    self.packing, self.tx, self.data_method, self._build = packing, tx, data_method, build

  def abstract_state(self, params_like):
    return jax.eval_shape(self._build, params_like)

  def saved_like(self, shapes: dict):
    """``None``: a pipeline checkpoint's leaf paths are its state's."""
    return None

  def export_state(self, saved) -> PortableState:
    return export_state(self.packing, self.data_method, saved)

  def export_params(self, saved):
    """The committed parameters, every stage's blocks gathered into the model's structure."""
    return self.export_state(saved).params
