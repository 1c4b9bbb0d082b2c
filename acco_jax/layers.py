"""The model of :mod:`acco_jax.model` in pieces: embedding, blocks in any order, head and loss.

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

import jax
import jax.numpy as jnp

from acco_jax import model

Params = model.Params


def _check(cfg: model.ModelConfig) -> None:
  if cfg.dropout > 0:
    raise ValueError(
      f"dropout={cfg.dropout}: the model's pieces (acco_jax.layers) run deterministically; set "
      "model.dropout=0 for pipelines and layer orders"
    )


def stack_blocks(blocks: Params) -> Params:
  """``{'0': block, '1': block, ...}`` -> one block tree whose leaves carry a leading [N] axis."""
  ordered = [blocks[str(i)] for i in range(len(blocks))]
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *ordered)


def unstack_blocks(blocks_N: Params) -> Params:
  """The inverse of :func:`stack_blocks`."""
  n = jax.tree.leaves(blocks_N)[0].shape[0]
  return {str(i): jax.tree.map(lambda p, i=i: p[i], blocks_N) for i in range(n)}


def embed(params: Params, cfg: model.ModelConfig, tokens_BxL) -> jax.Array:
  """The architecture's embedding of ``tokens_BxL`` (``params``: the model's or its shared part),
  in the compute dtype: [B, L', D]."""
  _check(cfg)
  return model.embed(model.shared(params), cfg, tokens_BxL)


def block(block_params: Params, cfg: model.ModelConfig, x_BxLxD, layer=0) -> jax.Array:
  """Block ``layer`` of the model (parameters ``block_params``) applied to ``x_BxLxD``."""
  _check(cfg)
  return model.block(block_params, cfg, x_BxLxD, model.context(x_BxLxD[..., 0], layer))


def run_blocks(
  blocks_N: Params, cfg: model.ModelConfig, x_BxLxD, order_K, count=None, first_layer=0
) -> jax.Array:
  """Applies the stacked blocks in the order ``order_K`` (int [K]; K = 0 is the identity map).

  Args:
    blocks_N: the blocks stacked by :func:`stack_blocks` (or any such tree with a leading axis).
    cfg: model config; ``cfg.remat`` rematerialises each block in the backward pass.
    x_BxLxD: the residual stream, in the compute dtype.
    order_K: block indices, a traced or concrete int array.
    count: if given (a traced or concrete int), only the first ``count`` entries of ``order_K``
      run; the others are skipped by a ``lax.cond`` (not computed; zero gradients). A pipeline
      stage with fewer blocks than the largest runs this way.
    first_layer: the model's index of ``blocks_N[0]`` (a pipeline stage's first block; traced or
      concrete): block ``order_K[k]`` is the model's ``first_layer + order_K[k]`` (the layer an
      architecture may treat apart, e.g. GPT-Neo's local blocks).

  Returns:
    The residual stream after the K (or ``count``) blocks.
  """
  _check(cfg)

  def apply(x_BxLxD, i):
    ctx = model.context(x_BxLxD[..., 0], first_layer + i)
    return model.block(jax.tree.map(lambda p: p[i], blocks_N), cfg, x_BxLxD, ctx)

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


def head_logits(params: Params, cfg: model.ModelConfig, x_BxLxD) -> jax.Array:
  """The architecture's head (``params``: the model's or its shared part): logits over the padded
  vocabulary, in the compute dtype."""
  return model.head_logits(model.shared(params), cfg, x_BxLxD)


def head_loss(params: Params, cfg: model.ModelConfig, x_BxLxD, batch: dict) -> tuple:
  """Head and mean cross-entropy over the weighted tokens, as :func:`acco_jax.model.loss_fn`.

  Returns:
    (loss, {'tokens', 'loss_sum'}), float32 scalars.
  """
  return model.loss_from_logits(cfg, head_logits(params, cfg, x_BxLxD), batch)


def loss_fn_ordered(params: Params, cfg: model.ModelConfig, batch: dict, order_K) -> tuple:
  """``model.loss_fn`` with the blocks run in the order ``order_K`` (see the module docstring).

  Gradients reach ``params['blocks']`` through the stacking: a block absent from ``order_K`` gets
  zeros.
  """
  x_BxLxD = embed(params, cfg, batch["inputs"])
  x_BxLxD = run_blocks(stack_blocks(params[model.BLOCKS]), cfg, x_BxLxD, order_K)
  return head_loss(params, cfg, x_BxLxD, batch)


def apply_ordered(params: Params, cfg: model.ModelConfig, tokens_BxL, order_K) -> jax.Array:
  """``model.apply`` with the blocks run in the order ``order_K``: float32 logits [B, L', V]."""
  x_BxLxD = embed(params, cfg, tokens_BxL)
  x_BxLxD = run_blocks(stack_blocks(params[model.BLOCKS]), cfg, x_BxLxD, order_K)
  return head_logits(params, cfg, x_BxLxD)[..., : cfg.V].astype(jnp.float32)
