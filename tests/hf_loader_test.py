"""The Hugging Face reader on what real uploads hold (issue 68, items 1, 7 and 8).

Against transformers' own logits of the stored fixtures (``tests/data/hf``, written by
``tests/hf_fixtures.py``; no torch here): a GPT-Neo checkpoint carrying the causal-mask buffers old
versions saved (a BOOL ``bias``, a ``masked_bias``) loads; a tied model whose file stores the head
anyway loads when that head is the embedding and is refused in one line when it is not; a file
cut short (an interrupted download) is refused in one line from its header, before any tensor is
read and before anything is written; a padded vocabulary (``model.vocab_multiple`` > 1) has zero
rows beyond ``V``; an export holds the tensor names transformers itself wrote.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax import errors, hf, model
from tests.hf_test import FIXTURES, TOL, _copy, _hf_config, _logits, _reference, _refused


def _rewrite(directory, edit, file=hf.WEIGHTS):
  """Rewrites one safetensors file of ``directory`` with ``edit(tensors)`` applied (dtypes kept)."""
  from safetensors.numpy import save_file

  path = str(directory / file)
  tensors = {name: np.array(hf._read(e)) for name, e in hf._header(path).items()}
  edit(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


def _one_line(info) -> str:
  message = str(info.value)
  assert "\n" not in message, message
  return message


# -- what real uploads hold ------------------------------------------------------------------------


def test_gpt_neo_with_old_mask_buffers_loads(tmp_path):
  """``h.N.attn.attention.bias`` (BOOL) and ``masked_bias`` are set aside before any dtype check
  (was: refused as "is BOOL")."""
  d = _copy(tmp_path, "gpt_neo")
  index = json.loads((d / hf.INDEX).read_text())
  first = index["weight_map"]["transformer.h.0.ln_1.weight"]
  L = hf.model_config(str(d)).L
  buffers = {}
  for i in range(hf.model_config(str(d)).N):
    buffers[f"transformer.h.{i}.attn.attention.bias"] = np.tril(np.ones((1, 1, L, L), bool))
    buffers[f"transformer.h.{i}.attn.attention.masked_bias"] = np.array(-1e9, np.float32)
  _rewrite(d, lambda t: t.update(buffers), first)
  index["weight_map"].update(dict.fromkeys(buffers, first))
  (d / hf.INDEX).write_text(json.dumps(index))
  assert {e.stored for e in hf.tensor_index(str(d)).values()} >= {"BOOL"}
  tokens, want = _reference("gpt_neo")
  np.testing.assert_allclose(_logits(d, tokens), want, **TOL)


def test_bool_tensor_the_model_reads_is_refused(tmp_path):
  """The dtype check still applies to the tensors the model reads."""
  d = _copy(tmp_path, "gpt2")
  name = "transformer.h.0.ln_1.bias"
  _rewrite(d, lambda t: t.update({name: t[name] > 0}))
  cfg = hf.model_config(str(d))
  with pytest.raises(errors.UserValueError, match=f"tensor {name} is BOOL: acco_jax reads") as info:
    hf.check_weights(str(d), cfg)
  _one_line(info)


def test_tied_gpt2_storing_its_head_gives_transformers_logits(tmp_path):
  d = _copy(tmp_path, "gpt2")
  _rewrite(d, lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"].copy()}))
  tokens, want = _reference("gpt2")
  np.testing.assert_allclose(_logits(d, tokens), want, **TOL)


def _tied_llama(tmp_path, head=lambda embedding: embedding.copy()):
  """The llama fixture as a tied model whose file also stores ``lm_head.weight`` (``head`` of the
  embedding)."""
  d = _copy(tmp_path, "llama")
  config = json.loads((d / hf.CONFIG).read_text())
  config["tie_word_embeddings"] = True
  (d / hf.CONFIG).write_text(json.dumps(config))
  _rewrite(d, lambda t: t.update({"lm_head.weight": head(t["model.embed_tokens.weight"])}))
  return d


def test_tied_llama_storing_its_head_loads(tmp_path):
  """(was: refused as a stray tensor) The head is the embedding: no ``lm_head`` parameter."""
  d = _tied_llama(tmp_path)
  cfg = hf.model_config(str(d), dtype="float32")
  params = hf.load_params(str(d), cfg)
  assert cfg.tied_head and "lm_head" not in params
  stored = np.array(hf._read(hf.tensor_index(str(d))["model.embed_tokens.weight"]), np.float32)
  np.testing.assert_array_equal(params["wte"]["embedding"][: cfg.V], stored)


@pytest.mark.parametrize("where", ["gpt2", "llama"])
def test_tied_head_that_differs_from_the_embedding_is_refused(tmp_path, where):
  if where == "llama":
    d, embedding = _tied_llama(tmp_path, lambda e: e * 2), "model.embed_tokens.weight"
  else:
    d, embedding = _copy(tmp_path, "gpt2"), "transformer.wte.weight"
    _rewrite(d, lambda t: t.update({"lm_head.weight": t[embedding][::-1].copy()}))
  with pytest.raises(
    errors.UserValueError, match=f"tensor lm_head.weight differs from {embedding}, but config"
  ) as info:
    hf.check_weights(str(d), hf.model_config(str(d)))
  _one_line(info)


# -- a file cut short: refused from its header, nothing read, nothing written ----------------------


def _truncate(directory, keep):
  path = directory / hf.WEIGHTS
  size = path.stat().st_size
  with open(path, "r+b") as f:
    f.truncate(keep(size))


TRUNCATED = {
  "last-bytes-missing": (
    lambda size: size - 100,
    r"model.safetensors is truncated or damaged: tensor ",
  ),
  "half-the-file": (lambda size: size // 2, r"model.safetensors is truncated or damaged: tensor "),
  "header-cut": (
    lambda size: 200,
    r"model.safetensors is truncated or damaged: the header ends at",
  ),
  "five-bytes": (lambda size: 5, r"truncated or damaged: the header's length ends at byte 8"),
}


@pytest.mark.parametrize("case", TRUNCATED)
def test_truncated_weights_are_refused_from_the_header(tmp_path, case):
  """(was: a 35-line traceback ending "mmap length is greater than file size")"""
  keep, match = TRUNCATED[case]
  d = _copy(tmp_path, "gpt2")
  _truncate(d, keep)
  with pytest.raises(errors.UserValueError, match=match) as info:
    hf.tensor_index(str(d))
  assert "download it again" in _one_line(info)


def test_truncated_weights_refused_before_anything_is_written(tmp_path):
  d = _copy(tmp_path, "gpt2")
  _truncate(d, lambda size: size - 100)
  config = _hf_config("gpt2")
  config.model.init, config.data.tokenizer = f"hf:{d}", f"hf:{FIXTURES / 'gpt2'}"
  _refused(config, "model.safetensors is truncated or damaged", tmp_path)


def test_tensor_of_the_wrong_byte_length_is_refused(tmp_path):
  """A header whose offsets disagree with a tensor's shape (a damaged or hand-made file)."""
  d = _copy(tmp_path, "gpt2")
  path = d / hf.WEIGHTS
  raw = path.read_bytes()
  (n,) = np.frombuffer(raw[:8], "<u8")
  header = json.loads(raw[8 : 8 + n])
  header["transformer.wpe.weight"]["shape"][0] -= 1
  text = json.dumps(header, separators=(",", ":")).encode().ljust(int(n))
  assert len(text) == n
  path.write_bytes(raw[:8] + text + raw[8 + n :])
  with pytest.raises(
    errors.UserValueError, match=r"tensor transformer.wpe.weight of shape"
  ) as info:
    hf.tensor_index(str(d))
  _one_line(info)


# -- vocabulary padding (mutation audit, issue 68 item 8a) ----------------------------------------


def test_padded_vocabulary_rows_are_zero_and_gradients_finite():
  """``model.vocab_multiple`` > 1 (the pretrained and gpt_neo-2.7b presets use 128): the rows
  beyond ``V`` are zero, the logits over ``V`` are transformers', and every gradient is finite.
  Fails if the loader leaves the padded rows as they were allocated: the heap is first filled
  with NaN in blocks of that size, so an unfilled row is NaN."""
  directory = str(FIXTURES / "gpt2")
  cfg = hf.model_config(directory, dtype="float32", vocab_multiple=128)
  assert cfg.padded_vocab > cfg.V
  rows = (cfg.padded_vocab, cfg.D)
  junk = [np.full(rows, np.nan, np.float32) for _ in range(8)]
  del junk  # freed: the loader's next array of this size reuses one of these blocks
  params = hf.load_params(directory, cfg)
  padded = np.asarray(params["wte"]["embedding"])[cfg.V :]
  np.testing.assert_array_equal(padded, np.zeros_like(padded))
  tokens, want = _reference("gpt2")
  logits = jax.jit(lambda p, t: model.apply(p, cfg, t))(params, jnp.asarray(tokens))
  np.testing.assert_allclose(np.asarray(logits), want, **TOL)
  batch = {
    "inputs": jnp.asarray(tokens[:, :-1]),
    "targets": jnp.asarray(tokens[:, 1:]),
    "weights": jnp.ones(tokens[:, 1:].shape, jnp.float32),
  }
  grads = jax.jit(jax.grad(lambda p: model.loss_fn(p, cfg, batch)[0]))(params)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


# -- export names (mutation audit, issue 68 item 8c) ----------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "gpt_neo", "llama"])
def test_export_holds_the_tensor_names_transformers_wrote(tmp_path, name):
  """The fixture's files were written by transformers' save_pretrained (a tied head left out):
  an export of its parameters holds exactly those names (no ``lm_head.weight`` for GPT-2)."""
  directory = str(FIXTURES / name)
  cfg = hf.model_config(directory, dtype="float32")
  out = hf.save(str(tmp_path / "export"), hf.load_params(directory, cfg), cfg)
  assert sorted(hf.tensor_index(out)) == sorted(hf.tensor_index(directory))
  if name == "gpt2":
    assert "lm_head.weight" not in hf.tensor_index(out)
    assert not os.path.exists(os.path.join(out, hf.INDEX))
