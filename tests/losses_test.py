"""The fused cross-entropy and vocabulary padding against plain float32 references written here.

Tolerances: with float32 logits the fused loss and its gradient equal the reference to float32
round-off (1e-6). With bfloat16 logits the loss is still exact (the statistics are float32 over the
same rounded logits) and the gradient is the reference's rounded to bfloat16 once: each element
within 2^-8 of its magnitude (bfloat16 keeps 8 significant bits), plus 1e-9 absolute for zeros.
On a tiny GPT in float32 the loss and every parameter gradient match the reference to 2e-5
(relative to the largest element of each leaf); a bfloat16 GPT's loss is within 1% of the float32
reference and its gradient within 5% in norm.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax import errors, losses, model, sampling


def ref_token_loss(logits, targets, num_classes):
  """Plain float32 log-softmax cross-entropy over the first ``num_classes`` columns."""
  z = logits[..., :num_classes].astype(jnp.float32)
  logp = z - jax.scipy.special.logsumexp(z, axis=-1, keepdims=True)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def ref_loss_sum(logits, targets, weights, num_classes):
  return jnp.sum(ref_token_loss(logits, targets, num_classes) * weights)


def _inputs(dtype, shape=(2, 5, 37), num_classes=37, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  logits = (3.0 * jax.random.normal(k1, shape)).astype(dtype)
  targets = jax.random.randint(k2, shape[:-1], 0, num_classes)
  weights = jax.random.uniform(k3, shape[:-1]) * (jnp.arange(shape[1]) % 3 != 0)
  return logits, targets, weights


def _vg(f):
  return jax.jit(jax.value_and_grad(f), static_argnums=3)


def _fused_sum(logits, targets, weights, num_classes):
  return losses.weighted_cross_entropy(logits, targets, weights, num_classes)[0]


def test_float32_logits_match_reference():
  logits, targets, weights = _inputs(jnp.float32)
  got, g_got = _vg(_fused_sum)(logits, targets, weights, 37)
  want, g_want = _vg(ref_loss_sum)(logits, targets, weights, 37)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-6)
  tokens = losses.weighted_cross_entropy(logits, targets, weights, 37)[1]
  np.testing.assert_allclose(tokens, jnp.sum(weights), rtol=1e-6)


def test_bfloat16_logits_exact_loss_and_rounded_gradient():
  logits, targets, weights = _inputs(jnp.bfloat16, shape=(3, 16, 300), num_classes=300)
  got, g_got = _vg(_fused_sum)(logits, targets, weights, 300)
  assert got.dtype == jnp.float32 and g_got.dtype == jnp.bfloat16
  as_f32 = logits.astype(jnp.float32)  # the reference sees the same rounded logits, in float32
  want, g_want = _vg(ref_loss_sum)(as_f32, targets, weights, 300)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  err = np.abs(np.asarray(g_got, np.float32) - np.asarray(g_want))
  assert np.all(err <= 2.0**-8 * np.abs(np.asarray(g_want)) + 1e-9), err.max()


def test_padded_columns_are_ignored_and_get_no_gradient():
  logits, targets, weights = _inputs(jnp.float32, shape=(2, 7, 40), num_classes=33)
  garbage = logits.at[..., 33:].set(50.0)  # would dominate the softmax if counted
  got, g_got = _vg(_fused_sum)(garbage, targets, weights, 33)
  want, g_want = _vg(ref_loss_sum)(logits, targets, weights, 33)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(g_got[..., :33], g_want[..., :33], rtol=1e-5, atol=1e-6)
  assert not np.any(np.asarray(g_got[..., 33:]))


def test_under_jit_and_vmap_shapes():
  logits, targets, _ = _inputs(jnp.bfloat16, shape=(4, 3, 20), num_classes=17)
  per_token = jax.jit(losses.token_cross_entropy, static_argnums=2)(logits, targets, 17)
  assert per_token.shape == (4, 3) and per_token.dtype == jnp.float32
  np.testing.assert_allclose(
    per_token, ref_token_loss(logits.astype(jnp.float32), targets, 17), rtol=1e-6
  )


# -- the model's loss ---------------------------------------------------------------------------

CFG32 = model.get_config("tiny", V=203, L=16, D=32, H=2, N=1, dtype="float32")


def _batch(cfg, seed=1, B=3):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return {
    "inputs": jax.random.randint(k1, (B, cfg.L), 0, cfg.V),
    "targets": jax.random.randint(k2, (B, cfg.L), 0, cfg.V),
    "weights": (jax.random.uniform(k3, (B, cfg.L)) > 0.2).astype(jnp.float32),
  }


def ref_model_loss(params, cfg, batch):
  """float32 logits of the real vocabulary from ``model.apply``, then the plain mean loss."""
  logits = model.apply(params, cfg, batch["inputs"])
  return ref_loss_sum(logits, batch["targets"], batch["weights"], cfg.V) / jnp.sum(batch["weights"])


def _close_trees(got, want, rel):
  for path, g, w in zip(
    jax.tree_util.tree_flatten_with_path(got)[0],
    jax.tree.leaves(got),
    jax.tree.leaves(want),
    strict=True,
  ):
    scale = float(np.max(np.abs(w))) or 1.0
    err = float(np.max(np.abs(np.asarray(g, np.float32) - np.asarray(w))))
    assert err <= rel * scale, (jax.tree_util.keystr(path[0]), err, scale)


@pytest.fixture(scope="module")
def tiny_gpt():
  """Parameters, a batch, and the float32 reference loss and gradient of the tiny GPT."""
  params, batch = model.init_params(CFG32, 0), _batch(CFG32)
  want = jax.jit(jax.value_and_grad(lambda p: ref_model_loss(p, CFG32, batch)))(params)
  return params, batch, want


def _model_vg(cfg, batch):
  return jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, cfg, batch)[0]))


def test_model_loss_and_param_gradients_match_reference_float32(tiny_gpt):
  params, batch, (want, g_want) = tiny_gpt
  got, g_got = _model_vg(CFG32, batch)(params)
  np.testing.assert_allclose(got, want, rtol=2e-6)
  _close_trees(g_got, g_want, 2e-5)


def test_model_loss_bfloat16_close_to_float32_reference(tiny_gpt):
  params, batch, (want, g_want) = tiny_gpt
  cfg16 = model.get_config("tiny", V=203, L=16, D=32, H=2, N=1, dtype="bfloat16")
  got, g_got = _model_vg(cfg16, batch)(params)
  np.testing.assert_allclose(got, want, rtol=1e-2)
  flat = lambda t: jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(t)])
  rel = float(jnp.linalg.norm(flat(g_got) - flat(g_want)) / jnp.linalg.norm(flat(g_want)))
  assert rel < 0.05, rel


# -- vocabulary padding -------------------------------------------------------------------------

PADDED = model.get_config("tiny", V=203, L=16, D=32, H=2, N=1, dtype="float32", vocab_multiple=64)


def _pad_wte(params, rows, value=0.0):
  out = jax.tree.map(lambda x: x, params)
  wte = params["wte"]["embedding"]
  out["wte"] = {"embedding": jnp.concatenate([wte, jnp.full((rows, wte.shape[1]), value)])}
  return out


def test_padded_shapes_and_init_keep_the_real_rows():
  assert PADDED.padded_vocab == 256 and CFG32.padded_vocab == 203
  assert model.get_config("gpt2", vocab_multiple=128).padded_vocab == 50304
  padded, plain = model.init_params(PADDED, 0), model.init_params(CFG32, 0)
  assert padded["wte"]["embedding"].shape == (256, 32)
  # exact: the same sampler on the same key and shape; the padding only appends zero rows
  np.testing.assert_array_equal(padded["wte"]["embedding"][:203], plain["wte"]["embedding"])
  assert not np.any(np.asarray(padded["wte"]["embedding"][203:]))
  for a, b in zip(jax.tree.leaves(padded), jax.tree.leaves(plain), strict=True):
    if a.shape == b.shape:
      np.testing.assert_array_equal(a, b)


def test_padded_model_loss_equals_unpadded_for_the_same_real_weights(tiny_gpt):
  params, batch, (want, g_want) = tiny_gpt  # the unpadded model's loss is checked against it above
  vg = _model_vg(PADDED, batch)
  got, g_got = vg(_pad_wte(params, 53))
  np.testing.assert_allclose(got, want, rtol=2e-6)
  g_wte = g_got["wte"]["embedding"]
  assert not np.any(np.asarray(g_wte[203:])), "padded rows must get no gradient"
  g_got["wte"]["embedding"] = g_wte[:203]
  _close_trees(g_got, g_want, 2e-5)
  # whatever the padded rows hold, the loss ignores them
  np.testing.assert_allclose(vg(_pad_wte(params, 53, value=3.0))[0], want, rtol=2e-6)


def test_apply_and_generate_never_expose_padded_ids():
  params = _pad_wte(model.init_params(CFG32, 0), 53, value=5.0)  # padded logits would win
  prompt = np.arange(4, dtype=np.int32)
  assert model.apply(params, PADDED, prompt[None]).shape == (1, 4, 203)
  greedy = sampling.generate(params, PADDED, prompt, 6, 0, temperature=0)
  sampled = sampling.generate(params, PADDED, prompt, 6, 1, temperature=1.0, top_k=5)
  assert int(greedy.max()) < 203 and int(sampled.max()) < 203


def test_flops_count_the_real_vocabulary():
  gpt2 = model.get_config("gpt2")
  assert model.flops_per_token(model.get_config("gpt2", vocab_multiple=128)) == (
    model.flops_per_token(gpt2)
  )
  assert math.isclose(model.flops_per_token(gpt2), 854_438_400)


@pytest.mark.parametrize("bad", [0, -128, 1.5])
def test_bad_vocab_multiple_is_a_one_line_error(bad):
  with pytest.raises(errors.UserValueError, match="vocab_multiple"):
    model.get_config("tiny", vocab_multiple=bad)


def test_one_pass_logsumexp_matches_two_passes():
  """The online (max, sum) reduction against the textbook logsumexp: large and spread values,
  columns of -inf (padding), a row of -inf only, and rows whose maximum comes last or first."""
  x = 40.0 * jax.random.normal(jax.random.key(3), (4, 6, 301))
  x = x.at[:, :, 250:].set(-jnp.inf)  # padded columns
  x = x.at[0, 0].set(-jnp.inf)  # nothing but padding
  x = x.at[1, 0, 249].set(500.0).at[1, 1, 0].set(500.0)  # a far maximum, last and first
  got = jax.jit(losses.logsumexp_one_pass)(x)
  want = jax.scipy.special.logsumexp(x, axis=-1)
  assert got[0, 0] == -jnp.inf
  np.testing.assert_allclose(got[1:], want[1:], rtol=1e-6)
  np.testing.assert_allclose(got[0, 1:], want[0, 1:], rtol=1e-6)
