"""The run-kind-independent content of a train state, for ``ckpt.init_from`` across run kinds.

A data-parallel state (:class:`acco_jax.dp.step.TrainState`: flat weights, ``[N, s_l]`` shards) and
a pipeline state (each stage's parameters packed in flat buffers over a ``stage`` axis) hold the
same training in different layouts. :class:`PortableState` is what they have in common, as host numpy arrays in the *model's own*
structure (``acco_jax.model.init_params``: ``{'blocks': {'0': ..., ...}, **shared}``):

- ``params``: the committed parameters θ, float32 (ACCO and WP: the committed copy, not the
  estimate θ̃ or the prediction θ̂ the next stage would compute at);
- ``opt``: the inner optimizer's state S (the config's optax optimizer,
  :func:`acco_jax.optim.from_config`: counts, injected hyperparameters, moments): every
  parameter-shaped subtree (Adam's ``mu`` and ``nu``, ...) in the model's structure and shapes,
  the other leaves as they are;
- ``updates``: optimizer updates done (what the trainer's update counter says: ACCO counts
  commits), from which the importing run picks its stage counter;
- ``source``: the method that wrote it (``acco``, ``zero1``, ``pipeline``, ...), for messages;
- ``dropped``: one phrase on what the export left behind ('' when nothing), e.g. ACCO's
  in-flight gradients.

Every value is moved, none is computed: converting a layout cuts padding off or adds zeros, and
stacks or unstacks arrays. Gradient buffers, quantization residuals and estimates are not part of
the form: a run that needs them starts them the way a fresh run does (see each family).

Contract for a family's step (what :mod:`acco_jax.run.init_from` calls):

``export_state(saved) -> PortableState``
  ``saved`` is the step's state as a checkpoint of it holds it: host numpy leaves with the shapes
  they were *written* with (any device count or mesh), in the tree structure of the step's
  ``abstract_state(params_shapes)``. The step that exports was built from the source run's config
  (the family's ``source_step``, :class:`acco_jax.family_api.Family`), on this process's devices.
``export_params(saved) -> params``
  The committed parameters alone, ``PortableState.params`` (``python -m acco_jax.export``; a LoCo
  step has this one only: its global parameters θ_g).
``import_state(portable, stage, microbatch=None) -> state``
  This run's state, placed like ``abstract_state`` (every device array sharded as the step
  runs it), with ``params`` and ``opt`` bit for bit and the stage counter ``stage`` (the trainer
  gives the first stage of update ``portable.updates``). ``microbatch`` is what ``init`` takes: a
  delayed method primes its gradient buffer with it; others ignore it. A portable form that does
  not fit (another model, another optimizer) is a one-line ``ValueError``.

:func:`map_param_subtrees` converts an optimizer state between layouts whatever the optimizer;
:func:`check_fits` is the importer's check; :func:`place` puts host arrays on devices. Pure: no
orbax, no flax, no data pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

PyTree = Any


class PortableState(NamedTuple):
  """A train state's parameters and inner optimizer state in the model's structure (host numpy).

  Attributes:
    params: the committed parameters θ, float32, ``model.init_params``'s structure and shapes.
    opt: the inner optimizer's state; parameter-shaped subtrees in the model's structure.
    updates: optimizer updates done.
    source: the method of the run it came from.
    dropped: what the export did not carry ('' when nothing), one phrase.
  """

  params: PyTree
  opt: PyTree
  updates: int
  source: str
  dropped: str = ""


def _shapes(tree) -> list[tuple[int, ...]]:
  return [tuple(np.shape(x)) for x in jax.tree.leaves(tree)]


def is_param_tree(x, params_like) -> bool:
  """Whether ``x`` has the structure of ``params_like`` and each leaf its leaf's shape."""
  treedef = jax.tree.structure(params_like)
  return jax.tree.structure(x) == treedef and _shapes(x) == _shapes(params_like)


def map_param_subtrees(fn: Callable[[PyTree], PyTree], state: PyTree, params_like: PyTree):
  """``state`` with ``fn(subtree)`` in place of every parameter-shaped subtree.

  A parameter-shaped subtree has the tree structure of ``params_like`` and, leaf by leaf, its
  shapes (dtypes may differ: bfloat16 moments). Whatever layout the step's parameters have (the
  model's tree, the ``[N, s_l]`` shards, a pipeline's per-stage buffers), ``params_like`` is that
  layout and ``fn`` converts one whole such subtree; the other leaves (counts, hyperparameters)
  are kept as they are.

  Args:
    fn: a function of one whole parameter-shaped subtree.
    state: an optimizer state (any pytree: optax NamedTuples, tuples, dicts).
    params_like: the parameters in the state's layout (arrays or ``ShapeDtypeStruct``).
  """
  match = lambda x: is_param_tree(x, params_like)
  return jax.tree.map(lambda x: fn(x) if match(x) else x, state, is_leaf=match)


def param_subtrees(state: PyTree, params_like: PyTree) -> list:
  """The parameter-shaped subtrees of ``state`` (see :func:`map_param_subtrees`), in order."""
  found = []
  map_param_subtrees(lambda x: found.append(x) or x, state, params_like)
  return found


def _spec(x) -> str:
  return f"{np.dtype(x.dtype).name}{list(np.shape(x))}"


def check_fits(portable: PortableState, params_like: PyTree, opt_like: PyTree) -> None:
  """Raises a one-line ``ValueError`` unless ``portable`` has this run's structure, shapes and
  dtypes: ``params`` those of ``params_like``, ``opt`` those of ``opt_like`` (both in the model's
  structure, e.g. ``jax.eval_shape`` of the model and of the inner optimizer's ``init``)."""
  for what, got, want in (
    ("params", portable.params, params_like),
    ("opt", portable.opt, opt_like),
  ):
    if jax.tree.structure(got) != jax.tree.structure(want):
      raise ValueError(
        f"its {what} have another tree structure than this run's ({len(jax.tree.leaves(got))} "
        f"leaves, {len(jax.tree.leaves(want))} here): another model or inner optimizer"
      )
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    for (path, x), y in zip(flat, jax.tree.leaves(want), strict=True):
      if np.shape(x) != tuple(y.shape) or np.dtype(x.dtype) != np.dtype(y.dtype):
        raise ValueError(
          f"{what}{jax.tree_util.keystr(path)} is {_spec(x)} in the source, {_spec(y)} here"
        )


def to_host(tree: PyTree) -> PyTree:
  """Every leaf as a numpy array (a device array is copied to the host whole)."""
  with jax.transfer_guard("allow"):
    return jax.tree.map(np.asarray, tree)


def place(host: PyTree, like: PyTree) -> PyTree:
  """Host numpy leaves -> device arrays with the shardings of ``like`` (``ShapeDtypeStruct`` with
  ``sharding``), bit for bit; every process passes the whole arrays and keeps its part."""
  if jax.tree.structure(host) != jax.tree.structure(like):
    raise ValueError("the state to place does not have the target's structure")

  def put(a, x):
    a = np.asarray(a)
    if a.shape != tuple(x.shape) or a.dtype != np.dtype(x.dtype):
      raise ValueError(f"a leaf is {_spec(a)}, the target's {_spec(x)}")
    return jax.make_array_from_callback(a.shape, x.sharding, lambda index: a[index])

  with jax.transfer_guard("allow"):
    return jax.tree.map(put, host, like)
