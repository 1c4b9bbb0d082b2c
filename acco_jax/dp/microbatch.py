"""Per-device microbatch gradient loops: the compute of a stage, with no collective in it.

:class:`MicrobatchLoop` holds the pieces that run *inside* the stage's ``shard_map`` on one device
(:mod:`acco_jax.dp.stage` owns the ``shard_map`` and the collectives). A stage may run its microbatches
as one loop or split them in two around the optimizer update; the carry between the pieces is::

  carry = (acc, used, loss_sum, aux_sum)
  acc      : float32 gradient sums, a tree shaped like the parameters
  used     : int32 microbatches added (not skipped)
  loss_sum : float32 sum of their losses
  aux_sum  : float32 sums of the loss function's auxiliary metrics

The trip count is static where every device runs all ``k`` microbatches (the default): the bounds are
Python ints, so XLA knows the loop's trip count and XLA:GPU runs it without reading anything back on
the host. With per-device budgets (heterogeneous workers) a device's count is a traced value and one
compiled program serves any counts up to ``k``; XLA:GPU then copies the loop predicate to the host at
every iteration, the price of a slow device doing fewer microbatches (a static loop with masked
iterations would make it compute all ``k``, which is what budgets are there to avoid).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from acco_jax.dp.flat import FlatLayout


def _varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``shard_map`` (jax 0.10: ``manual_axis_type``;
  other versions: ``vma``)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary_like(x, ref):
  """``x`` cast to varying over every manual mesh axis ``ref`` varies over (the data axis, and the
  worker axis when there are workers), so that it can join ``ref`` in a loop carry."""
  missing = tuple(sorted(_varying_axes(ref) - _varying_axes(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def loop_a_end(count, h):
  """Where a delayed stage's loop A ends for a device of ``count`` microbatches: ``min(count, h)``,
  static when ``count`` is."""
  return min(count, h) if isinstance(count, int) else jnp.minimum(count, h)


def loop_b_end(count, h):
  """Where its loop B (from ``h``) ends: ``max(count, h)``, static when ``count`` is."""
  return max(count, h) if isinstance(count, int) else jnp.maximum(count, h)


@functools.lru_cache(maxsize=64)
def grad_fn(loss_fn: Callable, has_aux: bool) -> Callable:
  """``(params, microbatch) -> ((loss, aux), grads)`` of ``loss_fn``, one ``jax.jit`` per loss.

  A stage's programs (the loops of every stage kind, a LoCo phase's inner steps, each fragment's
  phase) all call it on the same shapes: jit's trace cache traces the model's forward and backward
  once per process instead of once per loop, and XLA inlines the call when it compiles.
  """
  with_aux = loss_fn if has_aux else lambda p, b: (loss_fn(p, b), {})
  return jax.jit(jax.value_and_grad(with_aux, has_aux=True))


class MicrobatchLoop:
  """Forward and backward passes of ``k`` microbatches on one device, summed in float32.

  Args:
    loss_fn: ``loss_fn(params, microbatch)`` -> scalar, or ``(scalar, aux dict)`` with ``has_aux``.
    has_aux: whether ``loss_fn`` returns auxiliary metrics (summed like the loss).
    layout: the flat parameter layout (unravels the replicated weights).
    comm_dtype: dtype of the flat weights and of the buffer rows.
    axis_name: the data axis (the weights are cast to varying over it).
    k: microbatches per device per stage (the block each device's rows are split into).
    skip_nonfinite: drop a microbatch (gradient and count) whose loss or gradient is not finite.
  """

  def __init__(
    self,
    loss_fn: Callable,
    has_aux: bool,
    layout: FlatLayout,
    comm_dtype,
    axis_name: str,
    k: int,
    skip_nonfinite: bool = False,
  ):
    self.grad_fn = grad_fn(loss_fn, has_aux)
    self.layout, self.comm_dtype, self.axis, self.k = layout, comm_dtype, axis_name, k
    self.skip_nonfinite = skip_nonfinite

  def prepare(self, w_P, batch_local):
    """Varying compute weights (a tree) and the device's rows split into ``k`` microbatches.

    The gradient is taken at weights cast to *varying* over the data axis: at invariant weights JAX
    would all-reduce every microbatch's gradient (the transpose of their implicit broadcast).
    """
    params_var = self.layout.unravel(lax.pcast(w_P, self.axis, to="varying"), self.comm_dtype)
    k = self.k
    mbs = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch_local)
    return params_var, mbs

  def count(self, counts_1):
    """This device's microbatch count: its budget ``counts_1[0]`` (traced), or ``k`` (a Python int:
    static loop bounds) when the stage runs without budgets (``counts_1`` is ``None``)."""
    return self.k if counts_1 is None else counts_1[0]

  def start(self, params_var, mbs, buf_1xP=None, buf_count_1=None, keep=None, rest_1xP=None):
    """The initial carry, and the count ``n0`` already in it.

    With ``buf_1xP``, the sums start from the device's buffer row (and ``n0`` from its count) when
    ``keep`` (ACCO after a commit keeps g̃), else from ``rest_1xP`` (what a quantized send of the
    buffer did not deliver; it carries no count) or zero. Without a buffer they start from
    ``rest_1xP`` if given.
    """
    zero = vary_like(jnp.zeros((), jnp.float32), jax.tree.leaves(params_var)[0])
    no_count = vary_like(jnp.zeros((), jnp.int32), zero)  # varying, as a traced count would be
    rest = zero if rest_1xP is None else rest_1xP[0].astype(jnp.float32)
    if buf_1xP is not None:
      acc0 = self.layout.unravel(jnp.where(keep, buf_1xP[0].astype(jnp.float32), rest), jnp.float32)
      n0 = jnp.where(keep, buf_count_1[0], no_count)
    elif rest_1xP is not None:
      acc0, n0 = self.layout.unravel(rest, jnp.float32), no_count
    else:
      acc0 = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32) + zero, params_var)
      n0 = no_count
    mb0 = jax.tree.map(lambda x: x[0], mbs)
    aux_shape = jax.eval_shape(self.grad_fn, params_var, mb0)[0][1]
    aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32) + zero, aux_shape)
    return (acc0, no_count, zero, aux0), n0

  def accumulate(self, params_var, mbs, lo, hi, carry):
    """Adds microbatches ``[lo, hi)`` to ``carry``: Python-int bounds give XLA a loop of known trip
    count (none at all when ``lo == hi``), traced bounds one that XLA:GPU steers from the host."""

    def body(j, carry):
      acc, used, loss_sum, aux_sum = carry
      mb = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, j, keepdims=False), mbs)
      (loss, aux), g = self.grad_fn(params_var, mb)
      ok = jnp.bool_(True)
      if self.skip_nonfinite:  # drop the whole microbatch: its gradient and its count
        ok = jnp.isfinite(loss) & jnp.all(
          jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(g)])
        )
      add = lambda a, b: a + jnp.where(ok, b.astype(jnp.float32), 0.0)
      acc = jax.tree.map(add, acc, g)
      aux_sum = jax.tree.map(add, aux_sum, aux)
      return acc, used + ok.astype(jnp.int32), add(loss_sum, loss), aux_sum

    if isinstance(lo, int) and isinstance(hi, int) and hi <= lo:
      return carry
    return lax.fori_loop(lo, hi, body, carry)

  def finish(self, carry, count, n0):
    """The new ``[1, N*S]`` buffer row, its ``[1]`` count and this device's metric sums.

    The metric sums are per device; the stage reduces them over devices with one psum.
    """
    acc, used, loss_sum, aux_sum = carry
    totals = {
      "loss_sum": loss_sum,
      "microbatches": used.astype(jnp.float32),
      "skipped": (count - used).astype(jnp.float32),
      "aux": aux_sum,
    }
    return self.layout.ravel(acc, self.comm_dtype)[None], (n0 + used)[None], totals
