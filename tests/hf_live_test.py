"""Against the installed transformers itself (marked ``hf_live``; .ci/run installs torch and
transformers in its second step, the default suite reads the stored fixtures instead).

- The fixtures rebuilt with this transformers (tests/hf_fixtures.py): each loads and gives the
  logits transformers gives for it now.
- Each architecture imported, trained by this project and exported loads in
  ``transformers.AutoModelForCausalLM`` with the trained model's logits, and its tokenizer in
  ``AutoTokenizer`` with the same ids; GPT-Neo with a local window shorter than the sequence,
  Llama with grouped-query attention and an untied head.
- Shown able to fail: an export that drops the tied head (``tie_word_embeddings`` false, no
  ``lm_head``: transformers draws a head at random) no longer gives the trained logits.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax import hf, model
from acco_jax.run import trainer
from tests import hf_fixtures
from tests.hf_test import ARCHS, TOL, _logits

torch = pytest.importorskip("torch", reason="needs torch: pip install torch")
transformers = pytest.importorskip("transformers", reason="needs transformers")

pytestmark = pytest.mark.hf_live
CACHE = pathlib.Path(__file__).resolve().parent.parent / ".pytest_cache" / "acco_data"
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


def _train_and_export(directory, workdir, out):
  """Trains 2 updates from ``directory``, exports to ``out``; returns the trained parameters."""
  from acco_jax import export as export_lib
  from configs import gpt2_acco

  config = gpt2_acco.get_config("tiny")
  config.data.cache_dir = str(CACHE)
  config.ckpt.async_save, config.train.sample_tokens, config.train.eval_every = False, 0, 0
  config.model.init, config.model.size = f"hf:{directory}", "hf"
  config.data.tokenizer, config.model.dtype, config.train.num_updates = "hf", "float32", 2
  got = {}
  trainer.train_and_evaluate(config, str(workdir), on_params=got.update)
  export_lib.export(str(workdir), str(out))
  return jax.tree.map(np.asarray, got)


@pytest.fixture(scope="module")
def trained(rebuilt, tmp_path_factory):
  """Each rebuilt fixture trained 2 updates and exported: ``{name: (export dir, parameters)}``."""
  root = tmp_path_factory.mktemp("trained")
  out = {}
  for name, (directory, _) in rebuilt.items():
    out[name] = (
      root / name / "hf",
      _train_and_export(directory, root / name / "run", root / name / "hf"),
    )
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
