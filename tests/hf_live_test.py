"""Against the installed transformers itself (marked ``hf_live``; .ci/run installs torch and
transformers in its second step, the default suite reads the stored fixtures instead).

- The fixtures rebuilt with this transformers (tests/hf_fixtures.py): each loads and gives the
  logits transformers gives for it now.
- Each architecture imported, trained with this project's loss and written back loads in
  ``transformers.AutoModelForCausalLM`` with the trained model's logits, and its tokenizer in
  ``AutoTokenizer`` with the same ids; GPT-Neo with a local window shorter than the sequence,
  Llama with grouped-query attention and an untied head.
- Shown able to fail: an export that drops the tied head (``tie_word_embeddings`` false, no
  ``lm_head``: transformers draws a head at random) no longer gives the trained logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax import hf, model
from tests import hf_fixtures
from tests.hf_test import ARCHS, TOL, _logits

torch = pytest.importorskip("torch", reason="needs torch: pip install torch")
transformers = pytest.importorskip("transformers", reason="needs transformers")

pytestmark = pytest.mark.hf_live
TEXT = "And God said, Let there be light: and there was light."


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
  """The fixtures as this transformers writes them, with its logits."""
  root = tmp_path_factory.mktemp("hf")
  return {name: (root / name, hf_fixtures.build(name, str(root / name))) for name in ARCHS}


def _transformers_logits(directory, tokens):
  net = transformers.AutoModelForCausalLM.from_pretrained(
    str(directory), dtype=torch.float32, attn_implementation="eager"
  ).eval()
  with torch.no_grad():
    return net(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("name", ARCHS)
def test_rebuilt_fixture_gives_this_transformers_logits(rebuilt, name):
  directory, ref = rebuilt[name]
  np.testing.assert_allclose(_logits(directory, ref["tokens"]), ref["logits"], **TOL)


def _train_and_export(directory, out):
  """The checkpoint imported, trained by a few SGD steps of this project's loss on fixed rows,
  and written back (:func:`acco_jax.hf.save`, what ``python -m acco_jax.export`` writes; the
  export of each run kind from its checkpoints is tests/hf_test.py's). Returns the parameters."""
  from acco_jax import data

  cfg = hf.model_config(str(directory), dtype="float32")
  params = hf.load_params(str(directory), cfg)
  tokens = np.random.default_rng(0).integers(0, cfg.V, (4, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  grad = jax.jit(jax.grad(lambda p: model.loss_fn(p, cfg, batch)[0]))
  for _ in range(3):
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grad(params))
  tokenizer = data.get_tokenizer(f"hf:{directory}")
  hf.save(
    str(out), params, cfg, tokenizer=tokenizer, eos_id=tokenizer.eot_id, bos_id=tokenizer.bos_id
  )
  return jax.tree.map(np.asarray, params)


@pytest.fixture(scope="module")
def trained(rebuilt, tmp_path_factory):
  """Each rebuilt fixture trained and exported: ``{name: (export dir, parameters)}``."""
  root = tmp_path_factory.mktemp("trained")
  out = {}
  for name, (directory, _) in rebuilt.items():
    out[name] = (root / name, _train_and_export(directory, root / name))
  return out


@pytest.mark.parametrize("name", ARCHS)
def test_trained_export_loads_in_transformers_with_its_logits(rebuilt, trained, name):
  directory, ref = rebuilt[name]
  out, params = trained[name]
  cfg = hf.model_config(str(out), dtype="float32")
  tokens = ref["tokens"]
  want = np.asarray(model.apply(params, cfg, jnp.asarray(tokens)))
  assert np.max(np.abs(want - ref["logits"])) > 1e-3, "training did not move the parameters"
  np.testing.assert_allclose(_transformers_logits(out, tokens), want, **TOL)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
  from acco_jax import data

  ours = data.get_tokenizer(f"hf:{directory}")
  assert tokenizer(TEXT, add_special_tokens=False).input_ids == ours.encode(TEXT)
  assert tokenizer.eos_token_id == ours.eot_id


def test_an_export_that_drops_the_tied_head_fails_the_comparison(
  rebuilt, trained, tmp_path, monkeypatch
):
  directory, ref = rebuilt["gpt2"]
  good, params = trained["gpt2"]
  cfg = hf.model_config(str(directory), dtype="float32")
  config_of = hf.hf_config
  monkeypatch.setattr(
    hf, "hf_config", lambda *a, **k: {**config_of(*a, **k), "tie_word_embeddings": False}
  )
  hf.save(str(tmp_path / "untied"), params, cfg)
  want = np.asarray(model.apply(params, cfg, jnp.asarray(ref["tokens"])))
  got = _transformers_logits(tmp_path / "untied", ref["tokens"])
  with pytest.raises(AssertionError):
    np.testing.assert_allclose(got, want, **TOL)
  np.testing.assert_allclose(_transformers_logits(good, ref["tokens"]), want, **TOL)
