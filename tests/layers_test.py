"""acco_jax.layers: the model in pieces, and blocks run in a given order.

The identity order is compared with model.loss_fn (another program: a scan over stacked blocks against
an unrolled loop, so float tolerance, not bits). Skipped, swapped and repeated orders are compared with
a transformer block written here in plain jax.numpy from the architecture's definition.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax import layers, model

CFG = model.get_config("tiny", N=4, dtype="float32")
RTOL, ATOL = 2e-5, 2e-6  # float32, same operations composed in another program


@pytest.fixture(scope="module")
def params():
  return model.init_params(CFG, 0)


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, CFG.V, size=(3, 17), dtype=np.int32)
  weights = (rng.random((3, 16)) < 0.9).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def _layer_norm(x, p, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def _reference_block(p, x_BxLxD):
  B, L, D = x_BxLxD.shape
  H = CFG.H
  qkv = _layer_norm(x_BxLxD, p["ln_1"]) @ p["attn_qkv"]["kernel"] + p["attn_qkv"]["bias"]
  q, k, v = (qkv.reshape(B, L, 3, H, D // H)[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
  scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D // H)
  scores = jnp.where(np.tril(np.ones((L, L), bool)), scores, -jnp.inf)
  att = (jax.nn.softmax(scores, -1) @ v).transpose(0, 2, 1, 3).reshape(B, L, D)
  x_BxLxD = x_BxLxD + att @ p["attn_out"]["kernel"] + p["attn_out"]["bias"]
  h = _layer_norm(x_BxLxD, p["ln_2"]) @ p["mlp_fc"]["kernel"] + p["mlp_fc"]["bias"]
  h = 0.5 * h * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
  return x_BxLxD + h @ p["mlp_proj"]["kernel"] + p["mlp_proj"]["bias"]


def _reference_loss(params, batch, order):
  tokens = batch["inputs"]
  x = params["wte"]["embedding"][tokens] + params["wpe"]["embedding"][: tokens.shape[1]][None]
  for i in order:
    x = _reference_block(params["blocks"][str(i)], x)
  logits = _layer_norm(x, params["ln_f"]) @ params["wte"]["embedding"].T
  logp = jax.nn.log_softmax(logits, -1)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
  return (nll * batch["weights"]).sum() / batch["weights"].sum()


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL)


def test_identity_order_matches_model(params, batch):
  grad = jax.jit(jax.value_and_grad(layers.loss_fn_ordered, has_aux=True), static_argnums=1)
  (loss, aux), g = grad(params, CFG, batch, jnp.arange(CFG.N))
  (loss_ref, aux_ref), g_ref = jax.jit(
    jax.value_and_grad(model.loss_fn, has_aux=True), static_argnums=1
  )(params, CFG, batch)
  _close((loss, aux, g), (loss_ref, aux_ref, g_ref))


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [0, 2], [0, 3, 1, 2], [2, 2, 0]])
def test_order_matches_plain_jax_reference(params, batch, order):
  loss_and_grad = jax.jit(
    jax.value_and_grad(lambda p, o: layers.loss_fn_ordered(p, CFG, batch, o)[0])
  )
  loss, g = loss_and_grad(params, jnp.array(order))
  reference = jax.jit(
    jax.value_and_grad(_reference_loss), static_argnums=2
  )  # one program, not op by op
  loss_ref, g_ref = reference(params, batch, tuple(order))
  _close((loss, g), (loss_ref, g_ref))
  for i in range(CFG.N):  # a block the order leaves out learns nothing from this microbatch
    norm = sum(float(jnp.abs(x).sum()) for x in jax.tree.leaves(g["blocks"][str(i)]))
    assert (norm == 0) == (i not in order), (i, order, norm)


def test_apply_ordered_and_stack_round_trip(params, batch):
  logits = jax.jit(layers.apply_ordered, static_argnums=1)(
    params, CFG, batch["inputs"], jnp.arange(CFG.N)
  )
  _close(logits, jax.jit(model.apply, static_argnums=1)(params, CFG, batch["inputs"]))
  back = layers.unstack_blocks(layers.stack_blocks(params["blocks"]))
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, params["blocks"]))


def test_gpt_neo_traced_layers_give_transformers_logits():
  """The traced-layer path (the pipeline's and SkipPipe's: each block's index is traced, so GPT-Neo
  picks local or global attention by a ``lax.cond``) against transformers' logits of the stored
  fixture, whose local window is shorter than its tokens (tests/data/hf/gpt_neo)."""
  from acco_jax import hf
  from tests.hf_test import FIXTURES, TOL, _reference

  directory = str(FIXTURES / "gpt_neo")
  cfg = hf.model_config(directory, dtype="float32")
  tokens, want = _reference("gpt_neo")
  assert cfg.window < tokens.shape[1]
  params = hf.load_params(directory, cfg)
  apply = jax.jit(layers.apply_ordered, static_argnums=1)
  got = apply(params, cfg, jnp.asarray(tokens), jnp.arange(cfg.N))
  np.testing.assert_allclose(np.asarray(got), want, **TOL)
