"""Generation with the key/value cache (acco_jax.sampling, model.apply_cached) against the model's
own forward pass over the whole sequence, for every architecture (GPT-Neo's local window shorter
than the prompt, Llama's grouped-query attention), and greedy's stop ids on a hand-built model
whose replies are known.

Float32 tiny models with perturbed weights: the reference's top two logits differ by far more
than the cached path's float error at every step checked, so the tokens must be equal."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax import model, models, sampling

PROMPT_LENGTHS = (3, 13, 20)  # gpt_neo's and mistral's tiny windows are 8: the last two are longer
# the cached sampling's machinery does not depend on the architecture: one in the default run
SAMPLED = [a if a == "llama" else pytest.param(a, marks=pytest.mark.slow) for a in models.ARCHS]


@functools.cache
def _tiny(arch):
  cfg = model.get_config("tiny", arch=arch, dtype="float32")
  params = model.init_params(cfg, 0)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
  params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(keys), p.shape), params)
  return cfg, params


def _prompts(cfg, seed=0):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(0, cfg.V, n)] for n in PROMPT_LENGTHS]


def _reference_greedy(params, cfg, prompt, max_new):
  """Argmax of model.apply over the whole sequence so far, token by token; the smallest margin
  between the top two logits on the way."""
  apply = jax.jit(model.apply, static_argnums=1)
  tokens, margin = list(prompt), np.inf
  for _ in range(max_new):
    row_1xL = np.zeros((1, cfg.L), np.int32)  # one compiled length; causal: the padding after
    row_1xL[0, : len(tokens)] = tokens  # the last token does not change its logits
    logits_V = np.asarray(apply(params, cfg, row_1xL)[0, len(tokens) - 1])
    top2 = np.sort(logits_V)[-2:]
    margin = min(margin, top2[1] - top2[0])
    tokens.append(int(np.argmax(logits_V)))
  return tokens[len(prompt) :], margin


@pytest.mark.parametrize("arch", models.ARCHS)
def test_cached_logits_match_the_whole_sequence_forward(arch):
  cfg, params = _tiny(arch)
  tokens_BxS = jnp.asarray(np.random.default_rng(1).integers(0, cfg.V, (2, 24)), jnp.int32)
  want_BxSxV = jax.jit(model.apply, static_argnums=1)(params, cfg, tokens_BxS)
  P = 13  # the prompt's pass, longer than gpt_neo's window of 8, then one token a step
  positions_BxP = jnp.broadcast_to(jnp.arange(P), (2, P))
  step = jax.jit(model.apply_cached, static_argnums=1, static_argnames="length")
  got_BxPxV, cache = step(params, cfg, tokens_BxS[:, :P], positions_BxP, length=32)
  np.testing.assert_allclose(got_BxPxV, want_BxSxV[:, :P], atol=2e-5, rtol=0)
  for t in range(P, 24):
    got_Bx1xV, cache = step(params, cfg, tokens_BxS[:, t : t + 1], jnp.full((2, 1), t), cache)
    np.testing.assert_allclose(got_Bx1xV[:, 0], want_BxSxV[:, t], atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", models.ARCHS)
def test_cached_greedy_replies_are_the_whole_sequence_argmax(arch):
  cfg, params = _tiny(arch)
  prompts = _prompts(cfg)
  # bucket 16: the cache starts at 32 positions and grows to 64 during the replies
  got = sampling.greedy(params, cfg, prompts, 16, stop_id=-1, bucket=16)
  for prompt, reply in zip(prompts, got, strict=True):
    want, margin = _reference_greedy(params, cfg, prompt, 16)
    assert margin > 1e-3, "pick another seed: the reference's argmax is nearly tied"
    assert reply == want


@pytest.mark.parametrize("arch", SAMPLED)
def test_cached_sampling_matches_the_uncached_with_the_same_key(arch):
  cfg, params = _tiny(arch)
  prompt_BxT = np.random.default_rng(2).integers(0, cfg.V, (2, 28))
  # 28 + 40 > L = 64: the last steps see a sliding window, which the cache hands back
  kw = dict(temperature=0.9, top_k=20)
  got = sampling.generate(params, cfg, prompt_BxT, 40, jax.random.key(3), bucket=32, **kw)
  want = sampling.generate(params, cfg, prompt_BxT, 40, jax.random.key(3), cache=False, **kw)
  np.testing.assert_array_equal(got, want)


def test_cache_length_doubles_from_the_bucket_up_to_the_cap():
  assert [sampling.cache_length(n, 300) for n in (1, 128, 129, 256, 257, 1000)] == [
    128,
    128,
    256,
    256,
    300,
    300,
  ]
  assert sampling.cache_length(5, 64, bucket=16) == 16


# -- stop ids: a hand-built Llama whose next token is always the current one plus 1 -------------


@pytest.fixture(scope="module")
def counter():
  """Blocks that add nothing (zero output projections), embedding row t = e_t, head row v =
  10 e_(v-1): after token t < D - 1 the logits are 10 sqrt(D) at t + 1 and 0 elsewhere."""
  cfg = model.get_config("tiny", arch="llama", dtype="float32")
  params = model.init_params(cfg, 0)
  for block in params["blocks"].values():
    block["attn_out"]["kernel"] = jnp.zeros_like(block["attn_out"]["kernel"])
    block["mlp_down"]["kernel"] = jnp.zeros_like(block["mlp_down"]["kernel"])
  eye_VxD = jnp.eye(cfg.padded_vocab, cfg.D)
  params["wte"]["embedding"] = eye_VxD
  params["lm_head"] = 10.0 * jnp.roll(eye_VxD, 1, axis=0)
  return cfg, params


@pytest.mark.parametrize("cache", [True, False])
def test_greedy_stops_before_the_stop_id(counter, cache):
  cfg, params = counter
  prompts = [[10, 11], [30], [5, 6, 7]]
  got = sampling.greedy(params, cfg, prompts, 8, stop_id=15, cache=cache)
  assert got == [[12, 13, 14], [31, 32, 33, 34, 35, 36, 37, 38], [8, 9, 10, 11, 12, 13, 14]]
  got = sampling.greedy(params, cfg, prompts, 8, stop_id=(33, 9), cache=cache)
  assert got == [[12, 13, 14, 15, 16, 17, 18, 19], [31, 32], [8]]
  assert sampling.greedy(params, cfg, [[40]], 8, stop_id=[41], cache=cache) == [[]]


def test_generate_speed_benchmark_smoke(tmp_path):
  from bench.run import generate_speed

  out = tmp_path / "g.json"
  assert generate_speed.main(["--smoke", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(r["prompt"], r["new"]) for r in rows] == list(generate_speed.SMOKE_SETTINGS)
  assert all(r["same_replies"] and r["full_tok_s"] > 0 and r["cache_tok_s"] > 0 for r in rows)
