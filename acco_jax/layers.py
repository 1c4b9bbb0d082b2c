"""The GPT of :mod:`acco_jax.model` in pieces: embedding, one block, head and loss.

:func:`acco_jax.model.loss_fn` runs every block in order. Pipelines and SkipPipe's partial paths need
the pieces apart: stage 0 embeds and, at the end of a path, takes the head and the loss; every stage
runs its own blocks; a microbatch may skip blocks or run them in another order. The functions here
take the same parameter dict (``model.init_params``) and compute in ``cfg.dtype`` as the model does,
so that with the identity order

  loss_fn_ordered(params, cfg, batch, arange(N)) == model.loss_fn(params, cfg, batch)

to float tolerance (the same operations, composed in another program).

A layer order ``order_K`` is an int array of K block indices in [0, N): the microbatch runs block
``order_K[0]``, then ``order_K[1]``, ... A block that is absent gets a zero gradient; a block that
appears twice is applied twice. One compiled program serves every order of one length K: the blocks
are stacked on a leading axis and a ``lax.scan`` over the order indexes them.

Dropout is not applied here (deterministic pieces); configs with ``dropout > 0`` are refused.

Usage:
  blocks_N = layers.stack_blocks(params['blocks'])            # every leaf gets a leading [N] axis
  x_BxLxD = layers.embed(params, cfg, tokens_BxL)
  x_BxLxD = layers.run_blocks(blocks_N, cfg, x_BxLxD, jnp.array([0, 2, 1]))
  loss, aux = layers.head_loss(params, cfg, x_BxLxD, batch)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from acco_jax import model

Params = model.Params


@functools.lru_cache(maxsize=32)
def _graphdefs(cfg: model.GPTConfig):
  """Graph definitions of one block and of the final LayerNorm (abstract, nothing allocated)."""
  block_def, _ = nnx.split(nnx.eval_shape(lambda: model.Block(cfg, rngs=nnx.Rngs(0))))
  dt = jnp.dtype(cfg.dtype)
  ln_def, _ = nnx.split(
    nnx.eval_shape(lambda: nnx.LayerNorm(cfg.D, epsilon=cfg.ln_eps, dtype=dt, rngs=nnx.Rngs(0)))
  )
  return block_def, ln_def


def _check(cfg: model.GPTConfig) -> None:
  if cfg.dropout > 0:
    raise ValueError(
      f"dropout={cfg.dropout}: the model's pieces (acco_jax.layers) run deterministically; set "
      "model.dropout=0 for pipelines and layer orders"
    )


def _cast(tree, cfg: model.GPTConfig):
  dt = jnp.dtype(cfg.dtype)
  return jax.tree.map(lambda p: jnp.asarray(p).astype(dt), tree)


def stack_blocks(blocks: Params) -> Params:
  """``{'0': block, '1': block, ...}`` -> one block tree whose leaves carry a leading [N] axis."""
  ordered = [blocks[str(i)] for i in range(len(blocks))]
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *ordered)


def unstack_blocks(blocks_N: Params) -> Params:
  """The inverse of :func:`stack_blocks`."""
  n = jax.tree.leaves(blocks_N)[0].shape[0]
  return {str(i): jax.tree.map(lambda p, i=i: p[i], blocks_N) for i in range(n)}


def embed(params: Params, cfg: model.GPTConfig, tokens_BxL) -> jax.Array:
  """Token plus position embedding, in the compute dtype: [B, L', D]."""
  _check(cfg)
  L = tokens_BxL.shape[1]
  wte_VxD = _cast(params["wte"]["embedding"], cfg)
  wpe_LxD = _cast(params["wpe"]["embedding"], cfg)
  return wte_VxD[tokens_BxL] + wpe_LxD[:L][None]


def block(block_params: Params, cfg: model.GPTConfig, x_BxLxD) -> jax.Array:
  """One pre-LayerNorm transformer block (``model.Block``) applied to ``x_BxLxD``."""
  _check(cfg)
  block_def, _ = _graphdefs(cfg)
  return nnx.merge(block_def, _cast(block_params, cfg))(x_BxLxD, None, True)


def run_blocks(blocks_N: Params, cfg: model.GPTConfig, x_BxLxD, order_K, count=None) -> jax.Array:
  """Applies the stacked blocks in the order ``order_K`` (int [K]; K = 0 is the identity map).

  Args:
    blocks_N: the blocks stacked by :func:`stack_blocks` (or any such tree with a leading axis).
    cfg: model config; ``cfg.remat`` rematerialises each block in the backward pass.
    x_BxLxD: the residual stream, in the compute dtype.
    order_K: block indices, a traced or concrete int array.
    count: if given (a traced or concrete int), only the first ``count`` entries of ``order_K``
      run; the others are skipped by a ``lax.cond`` (not computed; zero gradients). A pipeline
      stage with fewer blocks than the largest runs this way.

  Returns:
    The residual stream after the K (or ``count``) blocks.
  """

  def apply(x_BxLxD, i):
    return block(jax.tree.map(lambda p: p[i], blocks_N), cfg, x_BxLxD)

  # Under a per-slot cond XLA keeps what the backward reads slot by slot (with the attention's
  # causal mask, which a plain scan hoists out of the loop), so the skippable slot saves only its
  # matmuls' outputs and recomputes the rest (masks, softmax, norms, GELU) in the backward.
  skippable = (
    apply if cfg.remat else jax.checkpoint(apply, policy=jax.checkpoint_policies.checkpoint_dots)
  )

  def one(x_BxLxD, i_k):
    i, k = i_k
    if count is None:
      return apply(x_BxLxD, i), None
    return jax.lax.cond(k < count, skippable, lambda x, _: x, x_BxLxD, i), None

  if cfg.remat:
    one = jax.checkpoint(one)
  order_K = jnp.asarray(order_K, jnp.int32)
  if order_K.shape[0] == 0:
    return x_BxLxD
  return jax.lax.scan(one, x_BxLxD, (order_K, jnp.arange(order_K.shape[0])))[0]


def head_logits(params: Params, cfg: model.GPTConfig, x_BxLxD) -> jax.Array:
  """Final LayerNorm and the tied head: logits over the padded vocabulary, in the compute dtype."""
  _, ln_def = _graphdefs(cfg)
  x_BxLxD = nnx.merge(ln_def, _cast(params["ln_f"], cfg))(x_BxLxD)
  return jnp.einsum("bld,vd->blv", x_BxLxD, _cast(params["wte"]["embedding"], cfg))


def head_loss(params: Params, cfg: model.GPTConfig, x_BxLxD, batch: dict) -> tuple:
  """Head and mean cross-entropy over the weighted tokens, as :func:`acco_jax.model.loss_fn`.

  Returns:
    (loss, {'tokens', 'loss_sum'}), float32 scalars.
  """
  return model.loss_from_logits(cfg, head_logits(params, cfg, x_BxLxD), batch)


def loss_fn_ordered(params: Params, cfg: model.GPTConfig, batch: dict, order_K) -> tuple:
  """``model.loss_fn`` with the blocks run in the order ``order_K`` (see the module docstring).

  Gradients reach ``params['blocks']`` through the stacking: a block absent from ``order_K`` gets
  zeros.
  """
  x_BxLxD = embed(params, cfg, batch["inputs"])
  x_BxLxD = run_blocks(stack_blocks(params["blocks"]), cfg, x_BxLxD, order_K)
  return head_loss(params, cfg, x_BxLxD, batch)


def apply_ordered(params: Params, cfg: model.GPTConfig, tokens_BxL, order_K) -> jax.Array:
  """``model.apply`` with the blocks run in the order ``order_K``: float32 logits [B, L', V]."""
  x_BxLxD = embed(params, cfg, tokens_BxL)
  x_BxLxD = run_blocks(stack_blocks(params["blocks"]), cfg, x_BxLxD, order_K)
  return head_logits(params, cfg, x_BxLxD)[..., : cfg.V].astype(jnp.float32)
