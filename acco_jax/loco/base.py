r"""The low-communication family as slots of one outer step (pure: no collectives, no Flax).

``M`` workers each train their own copy ``θ_m`` of the parameters with an inner optimizer (whose
state is kept across syncs and never averaged). At a sync, each worker's *pseudo-gradient* is

.. math::

  \Delta_m = \theta_g - \theta_m

(gradient sign: the outer optimizer *descends* along it), optionally compressed, averaged over
workers, and fed to an optax outer transform that updates the global parameters ``θ_g``; the result
is merged back into every worker, ``θ_m ← α θ_m + (1 − α) θ_g`` (``α = 0``: replace). A method is
one choice per slot (``loco-family.md`` §0), a :class:`LocoMethod`:

============  ===============  =================  ===============  ================  =============
slot          DiLoCo           Streaming DiLoCo   NoLoCo           SparseLoCo        DeMo
============  ===============  =================  ===============  ================  =============
schedule      every ``H``      a fragment every   every ``H``      every ``H``       every step
                               ``H/P``
payload       ``Δ``            ``Δ`` of the       ``Δ`` and ``φ``  ``Δ`` into the    the gradient
                               fragment                            error feedback    into momentum
compressor    none             FP4 (E3M0)         none             top-k per chunk,  DCT, top-k
                                                                   2-bit             per chunk
aggregator    all-reduce mean  all-reduce mean,   mean with one    all-gather,       all-gather,
                               in flight ``τ``    random peer      scatter-mean      scatter-mean
outer update  Nesterov SGD     the same, per      heavy-ball with  SGD, lr 1         sign-SGD
                               fragment           consensus
merge         replace          α-mix              replace by φ_i   replace           replace
============  ===============  =================  ===============  ================  =============

The last three use the slots :class:`Sparsify`, :class:`Pairing` and ``payload``, set by
:mod:`acco_jax.loco.sparseloco`, :mod:`~acco_jax.loco.noloco` and :mod:`~acco_jax.loco.demo`. This
module holds the pure pieces: the method record, the fragment partition, the host-side schedule and
the outer update of one fragment. :mod:`acco_jax.loco.step` runs them on the mesh;
:mod:`acco_jax.loco.replica` owns every collective over the worker (``replica``) axis.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from acco_jax import errors
from acco_jax.loco.compress import Compressor, get_compressor
from acco_jax.loco.compress.bits import BITS
from acco_jax.loco.compress.sparse import AGGREGATES
from acco_jax.loco.overlap import OVERLAPS

PyTree = Any

# A leaf belongs to transformer block i when its path has a component named like these followed by
# the block index (``['blocks']['3']`` in acco_jax.model; ``layers_3`` / ``h.3`` elsewhere).
_BLOCK = re.compile(r"(?:^|\W)(?:blocks|layers|h)[\W_]+(\d+)")


class Sparsify(NamedTuple):
  """Error-feedback top-k compression of the payload, sent by all-gather (SparseLoCo, DeMo).

  Every sync, per worker: ``e ← β e + c_t x`` (``x`` the payload, ``c_t`` = ``scale(t)`` or 1),
  the top-``k`` entries of each chunk of ``e`` (after a DCT with ``transform='dct'``), quantised to
  ``bits``, are sent and subtracted from ``e``; the workers' entries are then scatter-averaged
  (:class:`acco_jax.loco.compress.SparseCodec`).

  Attributes:
    decay: ``β`` in ``[0, 1)``.
    topk: ``k``, entries kept per chunk of ``chunk²`` values (see ``rule``).
    chunk: largest tile side / 1-D chunk length.
    rule: ``scaled`` (1-D chunks keep ``k`` per ``chunk²`` values) or ``clamped`` (``min(k, size)``).
    transform: ``none`` or ``dct``.
    bits: 2, 4, 8 (quantised values) or 32 (float32).
    aggregate: ``mean_contributors`` or ``mean_R``.
    scale: ``t -> c_t`` on the sync index, or None for 1 (DeMo: the learning rate).
  """

  decay: float
  topk: int
  chunk: int = 64
  rule: str = "scaled"
  transform: str = "none"
  bits: int = 32
  aggregate: str = "mean_contributors"
  scale: Any = None


class Pairing(NamedTuple):
  """Random pairs of workers (NoLoCo): ``count`` perfect matchings drawn from ``seed``, one picked
  per sync from ``seed`` and the sync index (:mod:`acco_jax.loco.noloco`)."""

  count: int = 16
  seed: int = 0


class LocoMethod(NamedTuple):
  """One member of the low-communication family: the choice of each slot of the outer step.

  Attributes:
    name: stable method name (``diloco``, ``streaming_diloco``, ...).
    sync_every: ``H``, inner steps between two syncs of the same fragment (of everything when
      ``fragments == 1``).
    outer: the outer optax transform, applied to the mean pseudo-gradient of a fragment; one state
      per fragment.
    fragments: ``P``, groups of transformer blocks synced in turn, one every ``H/P`` inner steps;
      the leaves outside the blocks (embeddings, final norm, head) belong to fragment 0.
    layout: ``strided`` (block ``l`` in fragment ``l mod P``) or ``sequential`` (contiguous).
    overlap_steps: ``τ``: the fragment's reduction is sent ``τ`` inner steps before it is applied
      and is in flight meanwhile (0: applied at once).
    alpha: merge factor, ``θ_m ← α θ_m + (1 − α) θ_g`` (0 replaces the local parameters).
    compressor: how the pseudo-gradient is quantised on the wire (all-reduce methods).
    sparse: a :class:`Sparsify` (sent by all-gather and scatter-mean) or None.
    pairing: a :class:`Pairing` (each worker averages with one peer) or None.
    payload: ``delta`` (``θ_g − θ_m``) or ``gradient`` (the inner step keeps the gradient and
      leaves the parameters alone; DeMo).
    outer_overlap: ``none`` (blocking), ``delayed`` or ``eager``: the reduction of a sync runs
      during the next phase (:mod:`acco_jax.loco.overlap`).
  """

  name: str
  sync_every: int
  outer: optax.GradientTransformation
  fragments: int = 1
  layout: str = "strided"
  overlap_steps: int = 0
  alpha: float = 0.0
  compressor: Compressor = get_compressor("none")
  sparse: Sparsify | None = None
  pairing: Pairing | None = None
  payload: str = "delta"
  outer_overlap: str = "none"

  @property
  def aggregate(self) -> str:
    """``mean`` (all-reduce), ``pairs`` (one peer, collective-permute) or ``sparse`` (all-gather)."""
    return "sparse" if self.sparse else "pairs" if self.pairing else "mean"

  @property
  def period(self) -> int:
    """``K = H / P``: inner steps between two consecutive fragment syncs."""
    return self.sync_every // self.fragments


def default_outer(lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True):
  """DiLoCo's outer optimizer, ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.

  With Nesterov and dampening 0 it applies ``u ← μ u + Δ``, ``θ_g ← θ_g − η (Δ + μ u)``, which is
  ``torch.optim.SGD(nesterov=True)``. Momentum 0 gives plain SGD (``θ_g ← θ_g − η Δ``).
  """
  return optax.sgd(lr, momentum=momentum or None, nesterov=bool(momentum) and nesterov)


def check(method: LocoMethod) -> None:
  """Raises a one-line ``ValueError`` for a method whose slots cannot work together."""
  h, p, tau = method.sync_every, method.fragments, method.overlap_steps
  if h < 1:
    raise ValueError(f"loco.sync_every={h} must be >= 1 (inner steps between syncs)")
  if p < 1 or h % p:
    raise ValueError(
      f"loco.sync_every={h} is not divisible by loco.fragments={p}: each fragment syncs once "
      "every H steps, one every H/P steps"
    )
  if not 0 <= tau < method.period:
    raise ValueError(
      f"loco.overlap_steps={tau} must be in [0, H/P = {method.period}): one fragment is in "
      "flight at a time"
    )
  if not 0.0 <= method.alpha <= 1.0:
    raise ValueError(f"loco.alpha={method.alpha} must be in [0, 1] (0 replaces, 1 keeps local)")
  if method.layout not in ("strided", "sequential"):
    raise ValueError(f"loco.layout={method.layout!r}: choose 'strided' or 'sequential'")
  if method.aggregate != "mean" and (p != 1 or tau or method.alpha):
    raise ValueError(
      f"{method.name} syncs every parameter at once: set loco.fragments=1, loco.overlap_steps=0 "
      "and loco.alpha=0"
    )
  if method.payload not in ("delta", "gradient"):
    raise ValueError(f"payload={method.payload!r}: choose 'delta' or 'gradient'")
  if method.payload == "gradient" and h != 1:
    raise ValueError(f"{method.name} updates every step: loco.sync_every={h} must be 1")
  if method.sparse is not None:
    _check_sparse(method.sparse)
  _check_overlap(method)
  if method.pairing is not None and method.pairing.count < 1:
    raise ValueError(f"loco.pairings={method.pairing.count} must be >= 1 (random matchings drawn)")


def _check_overlap(method: LocoMethod) -> None:
  mode = method.outer_overlap
  if mode not in OVERLAPS:
    raise ValueError(f"loco.outer_overlap={mode!r}: choose one of {', '.join(OVERLAPS)}")
  if mode == "none":
    return
  if method.aggregate == "pairs" or method.payload == "gradient":
    raise ValueError(
      f"loco.outer_overlap={mode!r} applies to diloco, streaming_diloco and sparseloco, not to "
      f"{method.name}; set loco.outer_overlap='none'"
    )
  if method.overlap_steps:
    raise ValueError(
      f"loco.outer_overlap={mode!r} already keeps a fragment's reduction in flight until the next "
      f"sync: set loco.overlap_steps=0 (got {method.overlap_steps})"
    )


def _check_sparse(s: Sparsify) -> None:
  if not 0.0 <= s.decay < 1.0:
    raise ValueError(f"loco.ef_decay={s.decay} must be in [0, 1) (error-feedback decay)")
  if s.chunk < 1:
    raise ValueError(f"loco.chunk={s.chunk} must be >= 1 (the largest tile side)")
  if not 1 <= s.topk <= s.chunk**2:
    raise ValueError(
      f"loco.topk={s.topk} must be in [1, loco.chunk^2 = {s.chunk**2}]: k values are kept per "
      "chunk, so more than a chunk holds cannot be sent"
    )
  if s.bits not in (*BITS, 32):
    raise ValueError(
      f"loco.bits={s.bits}: choose 2, 4 or 8 (quantised values) or 32 (float32, no quantiser)"
    )
  if s.aggregate not in AGGREGATES:
    raise ValueError(f"loco.aggregate={s.aggregate!r}: choose one of {', '.join(AGGREGATES)}")


# -- fragments ------------------------------------------------------------------------------------


def block_index(path: str) -> int | None:
  """The transformer block a leaf path belongs to (``None`` for embeddings, norms, head)."""
  m = _BLOCK.search(path)
  return int(m.group(1)) if m else None


def partition(tree: PyTree, fragments: int, layout: str = "strided") -> tuple[tuple[int, ...], ...]:
  """Leaf indices (in ``jax.tree.leaves`` order) of each fragment.

  Blocks go to fragments strided (block ``l`` to ``l mod P``) or sequentially (contiguous groups of
  ``ceil(N/P)``); every leaf outside the blocks goes to fragment 0. Raises ``ValueError`` if a
  fragment would be empty (more fragments than blocks).
  """
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  blocks = [block_index(p) for p in paths]
  ids = sorted({b for b in blocks if b is not None})
  if fragments == 1:
    return (tuple(range(len(paths))),)
  if len(ids) < fragments:
    raise ValueError(
      f"loco.fragments={fragments} but the model has {len(ids)} transformer blocks: use at most "
      "one fragment per block"
    )
  rank = {b: i for i, b in enumerate(ids)}
  per = -(-len(ids) // fragments)

  def frag(b):
    if b is None:
      return 0
    return rank[b] % fragments if layout == "strided" else rank[b] // per

  out = [[] for _ in range(fragments)]
  for i, b in enumerate(blocks):
    out[frag(b)].append(i)
  if any(not f for f in out):
    raise ValueError(
      f"loco.fragments={fragments} with the {layout} layout leaves a fragment without blocks "
      f"({len(ids)} blocks); use fewer fragments"
    )
  return tuple(tuple(f) for f in out)


def select(tree: PyTree, indices) -> dict[str, Any]:
  """The leaves of ``tree`` at ``indices`` as a dict keyed by the index (a fragment's view)."""
  leaves = jax.tree.leaves(tree)
  return {f"{i:04d}": leaves[i] for i in indices}


def replace(tree: PyTree, part: dict[str, Any]) -> PyTree:
  """``tree`` with the leaves of a fragment's view (from :func:`select`) replaced."""
  leaves, treedef = jax.tree.flatten(tree)
  for key, value in part.items():
    leaves[int(key)] = value
  return jax.tree.unflatten(treedef, leaves)


# -- schedule (host side, from the number of inner steps done) -----------------------------------


def apply_fragment(method: LocoMethod, steps_done: int) -> int | None:
  """The fragment whose outer update is applied once ``steps_done`` inner steps are done.

  Fragment ``p`` is applied after ``j H + (p + 1) H/P`` steps (``j >= 0``): each fragment once per
  ``H``, one every ``H/P``.
  """
  k = method.period
  if steps_done < k or steps_done % k:
    return None
  return (steps_done // k - 1) % method.fragments


def send_fragment(method: LocoMethod, steps_done: int) -> int | None:
  """The fragment whose pseudo-gradient is sent once ``steps_done`` steps are done (``τ > 0``):
  ``τ`` steps before it is applied."""
  if method.overlap_steps == 0:
    return None
  return apply_fragment(method, steps_done + method.overlap_steps)


# -- the outer step of one fragment (per worker; the mean comes from the aggregator) -------------


class OuterState(NamedTuple):
  """Outer state of one worker.

  Attributes:
    params: ``θ_g``, the global parameters (float32, the parameters' tree).
    opt: one outer optimizer state per fragment, each over that fragment's view (:func:`select`).
  """

  params: PyTree
  opt: tuple


def init_outer(method: LocoMethod, params: PyTree, parts) -> OuterState:
  """``θ_g`` = ``params`` and a fresh outer state per fragment (``parts`` from :func:`partition`)."""
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  return OuterState(params, tuple(method.outer.init(select(params, idx)) for idx in parts))


def pseudo_gradient(global_params: PyTree, local_params: PyTree) -> PyTree:
  """``Δ = θ_g − θ_m``: the direction the outer optimizer descends along."""
  return jax.tree.map(lambda g, m: g - m.astype(g.dtype), global_params, local_params)


def outer_update(
  method: LocoMethod, state: OuterState, mean_delta: dict, fragment: int, parts
) -> tuple[OuterState, dict]:
  """Applies the outer transform to fragment ``fragment`` with its mean pseudo-gradient.

  Returns the new outer state and the fragment's new ``θ_g`` view.
  """
  idx = parts[fragment]
  global_p = select(state.params, idx)
  updates, opt_p = method.outer.update(mean_delta, state.opt[fragment], global_p)
  new_p = optax.apply_updates(global_p, updates)
  opt = tuple(opt_p if i == fragment else s for i, s in enumerate(state.opt))
  return OuterState(replace(state.params, new_p), opt), new_p


def merge(local: PyTree, global_: PyTree, alpha: float) -> PyTree:
  """``α θ_m + (1 − α) θ_g`` (exactly ``θ_g`` when ``α = 0``, ``θ_m`` when ``α = 1``)."""
  if alpha == 0.0:
    return jax.tree.map(lambda m, g: g.astype(m.dtype), local, global_)
  if alpha == 1.0:
    return local
  return jax.tree.map(lambda m, g: (alpha * m + (1.0 - alpha) * g).astype(m.dtype), local, global_)


def check_owner(method: LocoMethod) -> None:
  """Refuses what the owner layout (whole matrices per device: an inner Muon) cannot run under
  ``method``: fragments by block (a slot holds other blocks' matrices on other devices), and the
  sparse and quantised payloads (their codecs cut each leaf's flat chunk)."""
  what = (
    f"loco.fragments={method.fragments}"
    if method.fragments != 1
    else f"method={method.name}'s sparse payload"
    if method.sparse is not None
    else f"loco.quantize={method.compressor.name}"
    if method.compressor.name != "none"
    else None
  )
  if what is not None:
    raise errors.UserValueError(
      f"{what} does not run with the owner layout of an inner optimizer that needs whole matrices "
      "(opt.name=muon) yet: use diloco, noloco or streaming_diloco with loco.fragments=1 and "
      "loco.quantize=none, or opt.name=adamw"
    )
