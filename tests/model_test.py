"""Tests for acco_jax.model: parameter counts, causality, a plain-jnp reference forward, the loss,
mixed precision, remat, the decay mask and sampling. Only the 'tiny' size is ever executed."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from acco_jax import model, sampling

TINY = model.get_config("tiny")
TINY_F32 = model.get_config("tiny", dtype="float32")


def _tokens(seed, shape, V=TINY.V):
  return jax.random.randint(jax.random.key(seed), shape, 0, V, dtype=jnp.int32)


@functools.cache
def _perturbed_params(seed=0):
  """Fresh params plus noise, so that zero biases and unit LayerNorm scales are not special."""
  params = model.init_params(TINY, seed)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  noisy = [p + 0.05 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys, strict=True)]
  return jax.tree.unflatten(treedef, noisy)


@functools.partial(jax.jit, static_argnums=1)
def _apply(params, cfg, tokens_BxL):
  return model.apply(params, cfg, tokens_BxL)


# Published GPT-2 sizes (tied embeddings, 50257-token vocabulary, 1024 positions).
@pytest.mark.parametrize("name, expected", [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168)])
def test_gpt2_param_counts(name, expected):
  cfg = model.get_config(name)
  shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
  assert model.num_params(shapes) == expected
  assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(shapes))


def test_tinystories_and_tiny_param_counts():
  cfg = model.get_config("tinystories-36m")
  n = model.num_params(jax.eval_shape(lambda: model.init_params(cfg, 0)))
  assert 33e6 <= n <= 40e6
  # Closed form: embeddings + N blocks (4 D^2 + 2 D F weights, 3D + D + F + D biases, 2 LayerNorms).
  V, L, D, N, F = TINY.V, TINY.L, TINY.D, TINY.N, 4 * TINY.D
  per_block = 4 * D * D + 2 * D * F + 3 * D + D + F + D + 4 * D
  n = model.num_params(jax.eval_shape(lambda seed: model.init_params(TINY, seed), 0))  # traced seed
  assert n == V * D + L * D + N * per_block + 2 * D


def test_gpt2_initialisation():
  cfg = model.get_config("tiny", N=8)  # N=8: residual std 0.02 / 4
  params = model.init_params(cfg, jax.random.key(3))
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert all(isinstance(p, jax.Array) and not isinstance(p, nnx.Variable) for p in leaves)
  assert all(p.dtype == jnp.float32 for p in leaves)
  block = params["blocks"]["5"]
  np.testing.assert_allclose(jnp.std(params["wte"]["embedding"]), 0.02, rtol=0.05)
  np.testing.assert_allclose(jnp.std(block["attn_qkv"]["kernel"]), 0.02, rtol=0.05)
  np.testing.assert_allclose(jnp.std(block["mlp_fc"]["kernel"]), 0.02, rtol=0.05)
  for name in ("attn_out", "mlp_proj"):  # residual projections: 0.02 / sqrt(2 N)
    np.testing.assert_allclose(jnp.std(block[name]["kernel"]), 0.02 / 4, rtol=0.05)
    assert float(jnp.abs(block[name]["bias"]).max()) == 0.0
  np.testing.assert_array_equal(block["ln_2"]["scale"], 1.0)
  np.testing.assert_array_equal(params["ln_f"]["bias"], 0.0)
  # Same seed, same params, whether given as an int, a typed key or a raw uint32 key.
  for seed in (3, jax.random.PRNGKey(3)):  # exact: the same program on the same key
    jax.tree.map(np.testing.assert_array_equal, model.init_params(cfg, seed), params)


def test_unknown_size_is_a_clear_value_error():
  with pytest.raises(ValueError, match=r"unknown model size 'gpt5'.*tiny.*gpt2-medium"):
    model.get_config("gpt5")


def test_wrong_params_are_rejected():
  params = model.init_params(TINY, 0)
  with pytest.raises(ValueError, match="wte"):
    model.apply(params, model.get_config("tiny", V=128), _tokens(0, (1, 8)))


def test_causal():
  params = _perturbed_params()
  tokens_BxL = _tokens(1, (2, TINY.L))
  t = 20
  changed_BxL = tokens_BxL.at[:, t].set((tokens_BxL[:, t] + 1) % TINY.V)
  a_BxLxV = _apply(params, TINY_F32, tokens_BxL)
  b_BxLxV = _apply(params, TINY_F32, changed_BxL)
  np.testing.assert_allclose(a_BxLxV[:, :t], b_BxLxV[:, :t], atol=1e-6)
  assert np.abs(a_BxLxV[:, t:] - b_BxLxV[:, t:]).max(axis=-1).min() > 1e-4


def _reference_forward(params, tokens_BxL, H, eps=1e-5):
  """GPT-2 forward written from the parameter dict with plain jnp (no flax, no fused attention)."""

  def layernorm(x, p):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]

  def dense(x, p):
    return x @ p["kernel"] + p["bias"]

  def gelu(x):
    return 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

  B, L = tokens_BxL.shape
  wte = params["wte"]["embedding"]
  x = wte[tokens_BxL] + params["wpe"]["embedding"][:L]
  D = x.shape[-1]
  mask_LxL = np.tril(np.ones((L, L), bool))
  for i in range(len(params["blocks"])):
    p = params["blocks"][str(i)]
    q, k, v = jnp.split(dense(layernorm(x, p["ln_1"]), p["attn_qkv"]), 3, axis=-1)
    q, k, v = (a.reshape(B, L, H, D // H).transpose(0, 2, 1, 3) for a in (q, k, v))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D // H)
    scores = jnp.where(mask_LxL, scores, -jnp.inf)
    probs = jnp.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    att = (probs @ v).transpose(0, 2, 1, 3).reshape(B, L, D)
    x = x + dense(att, p["attn_out"])
    x = x + dense(gelu(dense(layernorm(x, p["ln_2"]), p["mlp_fc"])), p["mlp_proj"])
  return layernorm(x, params["ln_f"]) @ wte.T


def test_matches_plain_jnp_reference():
  params = _perturbed_params()
  tokens_BxL = _tokens(2, (2, 48))
  with jax.default_matmul_precision("float32"):
    got = _apply(params, TINY_F32, tokens_BxL)
    want = jax.jit(_reference_forward, static_argnums=2)(params, tokens_BxL, TINY.H)
  assert got.dtype == jnp.float32 and got.shape == (2, 48, TINY.V)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_fresh_model_loss_is_log_vocab():
  params = model.init_params(TINY, 0)
  batch = {"inputs": _tokens(3, (4, TINY.L)), "targets": _tokens(4, (4, TINY.L))}
  loss, aux = jax.jit(model.loss_fn, static_argnums=1)(params, TINY, batch)
  assert loss.dtype == jnp.float32
  assert abs(float(loss) - math.log(TINY.V)) < 0.1
  assert float(aux["tokens"]) == 4 * TINY.L
  np.testing.assert_allclose(aux["loss_sum"], loss * 4 * TINY.L, rtol=1e-5)


def test_weights_select_tokens():
  params = _perturbed_params()
  inputs_BxL, targets_BxL = _tokens(5, (3, 32)), _tokens(6, (3, 32))
  weights_BxL = (jax.random.uniform(jax.random.key(7), (3, 32)) < 0.4).astype(jnp.float32)
  batch = {"inputs": inputs_BxL, "targets": targets_BxL, "weights": weights_BxL}
  loss_fn = jax.jit(model.loss_fn, static_argnums=1)
  loss, aux = loss_fn(params, TINY_F32, batch)

  # Manual cross-entropy from the logits, in float64 numpy.
  logits = np.asarray(_apply(params, TINY_F32, inputs_BxL), np.float64)
  m = logits.max(-1)
  logz = m + np.log(np.exp(logits - m[..., None]).sum(-1))
  target_logit = np.take_along_axis(logits, np.asarray(targets_BxL)[..., None], -1)[..., 0]
  w = np.asarray(weights_BxL)
  want_sum = ((logz - target_logit) * w).sum()
  np.testing.assert_allclose(aux["tokens"], w.sum())
  np.testing.assert_allclose(aux["loss_sum"], want_sum, rtol=1e-5)
  np.testing.assert_allclose(loss, want_sum / w.sum(), rtol=1e-5)

  # Targets of ignored tokens do not matter; no weighted token gives a finite 0.
  other = dict(batch, targets=jnp.where(weights_BxL > 0, targets_BxL, (targets_BxL + 7) % TINY.V))
  np.testing.assert_allclose(loss_fn(params, TINY_F32, other)[0], loss, rtol=1e-6)
  empty_loss, empty_aux = loss_fn(params, TINY_F32, dict(batch, weights=0 * weights_BxL))
  assert float(empty_loss) == 0.0 and float(empty_aux["tokens"]) == 0.0


def test_bf16_params_close_to_f32():
  params = _perturbed_params()
  params_bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  tokens_BxL = _tokens(8, (2, TINY.L))
  ref = _apply(params, TINY_F32, tokens_BxL)
  for cfg in (TINY, TINY_F32):  # bf16 compute, and bf16 params upcast to f32 compute
    got = _apply(params_bf16, cfg, tokens_BxL)
    assert got.dtype == jnp.float32 and bool(jnp.isfinite(got).all())
    rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    assert rel < 0.02, (cfg.dtype, rel)  # measured: 0.008 (bf16 compute), 0.005 (f32)
  assert float(jnp.abs(got - ref).max()) > 0  # the bf16 rounding was really applied


def test_remat_same_loss_and_grads():
  params = _perturbed_params()
  batch = {"inputs": _tokens(9, (2, 32)), "targets": _tokens(10, (2, 32))}
  remat_cfg = model.get_config("tiny", dtype="float32", remat=True)
  grad_fn = jax.value_and_grad(lambda p, cfg: model.loss_fn(p, cfg, batch)[0])
  loss, grads = jax.jit(grad_fn, static_argnums=1)(params, TINY_F32)
  loss_r, grads_r = jax.jit(grad_fn, static_argnums=1)(params, remat_cfg)
  np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads_r, grads)
  assert "remat" in str(jax.make_jaxpr(grad_fn, static_argnums=1)(params, remat_cfg))
  assert "remat" not in str(jax.make_jaxpr(grad_fn, static_argnums=1)(params, TINY_F32))


def test_dropout():
  params = model.init_params(TINY, 0)
  cfg = model.get_config("tiny", dtype="float32", dropout=0.2)
  tokens_BxL = _tokens(11, (2, 16))
  run = jax.jit(model.apply, static_argnums=1, static_argnames="deterministic")
  clean = run(params, cfg, tokens_BxL)
  np.testing.assert_allclose(clean, _apply(params, TINY_F32, tokens_BxL), atol=1e-6)
  a = run(params, cfg, tokens_BxL, rng=jax.random.key(0), deterministic=False)
  b = run(params, cfg, tokens_BxL, rng=jax.random.key(0), deterministic=False)
  c = run(params, cfg, tokens_BxL, rng=jax.random.key(1), deterministic=False)
  np.testing.assert_array_equal(a, b)
  assert float(jnp.abs(a - clean).max()) > 1e-3 and float(jnp.abs(a - c).max()) > 1e-3
  with pytest.raises(ValueError, match="rng"):
    model.apply(params, cfg, tokens_BxL, deterministic=False)


def test_decay_mask():
  params = model.init_params(TINY, 0)
  mask = model.decay_mask(params)
  assert jax.tree.structure(mask) == jax.tree.structure(params)
  block = mask["blocks"]["1"]
  assert mask["wte"]["embedding"] is True and mask["wpe"]["embedding"] is True
  assert block["attn_qkv"]["kernel"] is True and block["mlp_proj"]["kernel"] is True
  assert block["attn_qkv"]["bias"] is False and block["mlp_fc"]["bias"] is False
  assert block["ln_1"]["scale"] is False and mask["ln_f"]["bias"] is False
  assert model.decay_mask(jax.eval_shape(lambda: params)) == mask


def test_flops_per_token_matches_6n_rule():
  cfg = model.get_config("gpt2")
  n = model.num_params(jax.eval_shape(lambda: model.init_params(cfg, 0)))
  # Kaplan/PaLM rule: 6 x (params without position embeddings) + 12 N D L attention term.
  rule = 6 * (n - cfg.L * cfg.D) + 12 * cfg.N * cfg.D * cfg.L
  assert abs(model.flops_per_token(cfg) / rule - 1) < 0.005


def test_generate():
  params = _perturbed_params()
  prompt_BxT = np.asarray(_tokens(12, (2, 60)))  # 60 + 8 > L = 64: exercises the cropping
  out = sampling.generate(params, TINY, prompt_BxT, 8, jax.random.key(0), top_k=20)
  assert out.shape == (2, 68) and out.dtype == jnp.int32
  np.testing.assert_array_equal(out[:, :60], prompt_BxT)
  assert int(out.min()) >= 0 and int(out.max()) < TINY.V
  again = sampling.generate(params, TINY, prompt_BxT, 8, jax.random.key(0), top_k=20)
  np.testing.assert_array_equal(out, again)
  other = sampling.generate(params, TINY, prompt_BxT, 8, jax.random.key(1), top_k=20)
  assert not np.array_equal(out, other)

  # Greedy decoding agrees with argmax of the full forward pass, also after cropping to L tokens.
  greedy = sampling.generate(params, TINY_F32, prompt_BxT[0], 6, 0, temperature=0.0)
  assert greedy.shape == (66,)
  for n in (60, 65):
    window = greedy[None, max(0, n - TINY.L) : n]
    want = int(jnp.argmax(_apply(params, TINY_F32, window)[0, -1]))
    assert int(greedy[n]) == want


@pytest.mark.parametrize("dtype", ["int8", "bool", "float33"])
def test_config_refuses_a_dtype_the_model_cannot_compute_in(dtype):
  with pytest.raises(
    ValueError, match=rf"^dtype='{dtype}' is not a floating dtype: use 'bfloat16'"
  ):
    model.get_config("tiny", dtype=dtype)


# -- the field schema and the architectures' presets ------------------------------------------------


def test_field_schema_derives_sizes_settings_and_users():
  from acco_jax.models import base
  from acco_jax.run import presets

  assert presets.SIZES == ("D", "H", "N", "F", "kv_heads", "K")
  assert presets.SETTINGS == ("dtype", "remat", "dropout", "attention", "vocab_multiple")
  assert base.users("window") == base.users("layer_types") == ("gpt_neo", "mistral")
  assert base.users("kv_heads") == ("llama", "qwen2", "qwen3", "mistral")
  assert base.users("norm_eps") == base.ARCHS
  assert all(isinstance(f, base.Field) for f in base.FIELDS.values())


@pytest.mark.parametrize(
  "arch, field, value, users",
  [
    ("gpt2", "window", 8, "gpt_neo, mistral"),
    ("gpt_neo", "tied_head", False, "llama, qwen2, qwen3, mistral"),
    ("qwen2", "layer_types", "local", "gpt_neo, mistral"),
  ],
)
def test_a_field_another_architecture_uses_is_refused(arch, field, value, users):
  from acco_jax import errors

  with pytest.raises(
    errors.UserValueError, match=f"does not use {field}=.*\\({field} is {users}'s\\)$"
  ):
    model.get_config("tiny", arch=arch, **{field: value})


# Parameter counts of the published models the presets name (their model cards' totals).
@pytest.mark.parametrize(
  "arch, size, expected",
  [
    ("qwen2", "0.5b", 494_032_768),  # Qwen2.5-0.5B
    ("qwen3", "0.6b", 596_049_920),  # Qwen3-0.6B
    ("mistral", "7b", 7_241_732_096),  # Mistral-7B-v0.1
    ("llama", "3.2-1b", 1_235_814_400),  # Llama-3.2-1B
  ],
)
def test_published_preset_param_counts(arch, size, expected):
  shapes = model.param_shapes(model.get_config(size, arch=arch))
  assert sum(math.prod(s.shape) for s in jax.tree.leaves(shapes)) == expected


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neo", "llama", "qwen2", "qwen3", "mistral"])
def test_every_preset_reads_back_from_its_config_json(arch):
  from acco_jax import models

  for size in model.sizes(arch):
    cfg = model.get_config(size, arch=arch, dtype="float32")
    fields = models.from_hf_config(arch, models.get(arch).to_hf_config(cfg))
    assert model.ModelConfig(**fields, arch=arch, dtype="float32") == cfg, size
