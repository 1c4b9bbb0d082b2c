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

import json
import os
import shutil

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


# -- chat templates: the trained mask against transformers' assistant mask ------------------------

CHAT = [
  {"role": "user", "content": "What is 2+2?"},
  {"role": "assistant", "content": " It is 4.\nSure."},
  {"role": "user", "content": "And 3+3?"},
  {"role": "assistant", "content": "6"},
]
# ChatML (SmolLM2's layout) with the assistant's text and its <|im_end|> in generation marks
MARKED_CHATML = (
  "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
  "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}"
  "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
  "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
  "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
  "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _smollm2_dir() -> str:
  """The SmolLM2 directory .ci/run builds (``SMOLLM2_DIR``, scripts/smollm2.py's output)."""
  d = os.environ.get("SMOLLM2_DIR")
  if d and os.path.isfile(os.path.join(d, "model.safetensors")):
    return d
  pytest.skip("needs the SmolLM2 directory (SMOLLM2_DIR=<scripts/smollm2.py's output>)")


def _chat_dir(out, template, tokenizer_json=None):
  """A tokenizer directory with ``template``: GPT-2's byte-level BPE (the fixture's) with ChatML's
  special tokens added, or a given ``tokenizer.json``."""
  import tokenizers

  out.mkdir()
  if tokenizer_json is None:
    tok = tokenizers.Tokenizer.from_file(
      os.path.join(hf_fixtures.FIXTURES, "gpt2", "tokenizer.json")
    )
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(out / "tokenizer.json"))
  else:
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
  settings = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "chat_template": template,
  }
  (out / "tokenizer_config.json").write_text(json.dumps(settings))
  return out


def _our_mask(directory, messages, tmp_path):
  from acco_jax.data import examples, instruct
  from acco_jax.data.tokenizer import get_tokenizer

  tok = get_tokenizer(f"hf:{directory}")
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"messages": messages}) + "\n")
  exs = instruct.read_jsonl(str(path), "chat", examples.template_of(tok, "hf"))
  encoded = examples.encode(tok, exs)
  ids, trained = encoded.example(0)
  return ids.tolist(), trained.astype(int).tolist(), examples.prompt_ids(encoded, 0).tolist()


def _transformers_mask(directory, messages):
  tok = transformers.AutoTokenizer.from_pretrained(str(directory))
  out = tok.apply_chat_template(
    messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
  )
  return list(out["input_ids"]), list(out["assistant_masks"])


def test_marked_template_trains_transformers_assistant_tokens(tmp_path):
  directory = _chat_dir(tmp_path / "marked", MARKED_CHATML)
  ids, mask = _transformers_mask(directory, CHAT)
  assert 0 < sum(mask) < len(mask)
  got_ids, got_mask, prompt = _our_mask(directory, CHAT, tmp_path)
  assert (got_ids, got_mask) == (ids, mask)
  # exact match's prompt: the conversation before the last reply with the generation prompt
  want = transformers.AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
    CHAT[:-1], tokenize=True, add_generation_prompt=True, return_dict=True
  )["input_ids"]
  assert prompt == list(want)


def test_smollm2_template_without_marks_trains_what_its_marked_twin_marks(tmp_path):
  """SmolLM2's own template (no generation marks) derives the tokens transformers marks under the
  same template with marks added; both render the same ids."""
  source = _smollm2_dir()
  with open(os.path.join(source, "chat_template.jinja")) as f:
    template = f.read()
  assert "{% generation" not in template
  system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
  twin = MARKED_CHATML.replace("Be brief.", system)
  plain = _chat_dir(tmp_path / "plain", template, os.path.join(source, "tokenizer.json"))
  marked = _chat_dir(tmp_path / "twin", twin, os.path.join(source, "tokenizer.json"))
  ids, mask = _transformers_mask(marked, CHAT)
  want_ids = transformers.AutoTokenizer.from_pretrained(source).apply_chat_template(
    CHAT, tokenize=True, return_dict=True
  )["input_ids"]
  assert list(want_ids) == ids  # the twin renders SmolLM2's text
  assert _our_mask(plain, CHAT, tmp_path)[:2] == (ids, mask)


def test_smollm2_export_keeps_its_chat_template_generation_config_and_floats(tmp_path):
  from acco_jax.data import examples
  from acco_jax.data.tokenizer import get_tokenizer

  source = _smollm2_dir()
  cfg = hf.model_config(source, dtype="float32")
  tok = get_tokenizer(f"hf:{source}")
  stops = examples.turn_end_ids(tok)
  assert stops == (2,)  # <|im_end|>: its end-of-text and its end-of-turn
  out = tmp_path / "export"
  hf.save(
    str(out), hf.load_params(source, cfg), cfg, tokenizer=tok, eos_id=tok.eot_id,
    bos_id=tok.bos_id, stop_ids=stops, source_dir=source,
  )  # fmt: skip
  for name in ("config.json", "generation_config.json"):
    with open(os.path.join(source, name)) as f:
      theirs = json.load(f)
    with open(out / name) as f:
      ours = json.load(f)
    for key in ("rms_norm_eps", "rope_parameters", "eos_token_id", "bos_token_id", "pad_token_id"):
      if key in theirs:
        assert json.dumps(ours[key], sort_keys=True) == json.dumps(theirs[key], sort_keys=True)
  generation = transformers.GenerationConfig.from_pretrained(str(out))
  assert generation.eos_token_id == 2 and generation.pad_token_id == 2
  question = CHAT[:1]
  want = transformers.AutoTokenizer.from_pretrained(source).apply_chat_template(
    question, tokenize=True, add_generation_prompt=True, return_dict=True
  )["input_ids"]
  got = transformers.AutoTokenizer.from_pretrained(str(out)).apply_chat_template(
    question, tokenize=True, add_generation_prompt=True, return_dict=True
  )["input_ids"]
  assert list(got) == list(want) and len(want) > 5
