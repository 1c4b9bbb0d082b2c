"""Tiny random Hugging Face checkpoints of each architecture, and the logits transformers gives.

``python tests/hf_fixtures.py`` (needs torch and transformers) writes ``tests/data/hf/<name>/``:
``config.json``, the weights, the tokenizer, and ``reference.npz`` (fixed token ids and
transformers' float32 logits for them, eager attention). The default suite reads them without
torch (tests/hf_test.py); the ``hf_live`` tests build them again with the installed transformers.

Every parameter is drawn at random, biases and norm scales included (transformers' own
initialisation leaves biases at 0 and scales at 1, which would hide a bias or a scale read into
the wrong place). The fixtures cover what a mapping can get wrong:

- ``gpt2``: float32, one ``model.safetensors``; Conv1D weights, fused q|k|v, tied head.
- ``gpt_neo``: float32, weights in two shards with ``model.safetensors.index.json``; 4 blocks
  alternating global and local attention, the local window (4) shorter than the sequence (16).
- ``llama``: bfloat16 weights; grouped-query attention (4 query heads over 2 key/value heads), an
  untied head, a non-default ``rope_theta`` and RMSNorm epsilon.
- ``llama3``, ``llama_linear``: Llama with RoPE scaled as Llama 3.1 scales it (of the head's 4
  frequencies one kept, one mixed, two divided: the thresholds straddle them) and linearly.
- ``qwen2``: q, k and v biases, a tied head.
- ``qwen3``: q and k RMSNorms, a head width (16) other than D / H (8), an untied head.
- ``mistral``: a sliding window (4) shorter than the sequence.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "data", "hf")
NAMES = ("gpt2", "gpt_neo", "llama", "llama3", "llama_linear", "qwen2", "qwen3", "mistral")
TEXT = "In the beginning God created the heaven and the earth. And the earth was without form."
SEQ = 16  # tokens per reference row
VOCAB = 320  # the tiny tokenizer's ids (256 bytes, specials, merges)


def _tokenizer(eos: str, bos: str | None):
  """A byte-level BPE of ``VOCAB`` ids trained on a few verses, as a transformers tokenizer."""
  import tokenizers
  import transformers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  corpus = [TEXT, "And God said, Let there be light: and there was light."] * 20
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = [eos] + ([bos] if bos else [])
  trainer = trainers.BpeTrainer(
    vocab_size=VOCAB,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(corpus, trainer=trainer)
  kwargs = {"eos_token": eos, **({"bos_token": bos} if bos else {})}
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def _config(name: str, vocab: int, eos_id: int, bos_id: int):
  import transformers

  common = dict(vocab_size=vocab, eos_token_id=eos_id, bos_token_id=bos_id)
  if name == "gpt2":
    return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)
  if name == "gpt_neo":
    return transformers.GPTNeoConfig(
      hidden_size=32,
      num_layers=4,
      num_heads=4,
      max_position_embeddings=64,
      window_size=4,
      attention_types=[[["global", "local"], 2]],
      **common,
    )
  family = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    **common,
  )
  rope = {"rope_type": "default", "rope_theta": 5000.0}
  if name == "llama3":  # wavelengths 6.3, 53, 445, 3738 against thresholds 8 and 64
    rope = dict(
      rope_type="llama3",
      rope_theta=5000.0,
      factor=8.0,
      low_freq_factor=0.5,
      high_freq_factor=4.0,
      original_max_position_embeddings=32,
    )
  if name == "llama_linear":
    rope = dict(rope_type="linear", rope_theta=5000.0, factor=4.0)
  if name == "qwen2":
    return transformers.Qwen2Config(**family, rope_parameters=rope, tie_word_embeddings=True)
  if name == "qwen3":
    return transformers.Qwen3Config(
      **family, head_dim=16, rope_parameters=rope, tie_word_embeddings=False
    )
  if name == "mistral":
    return transformers.MistralConfig(
      **family, sliding_window=4, rope_parameters=rope, tie_word_embeddings=False
    )
  return transformers.LlamaConfig(**family, rope_parameters=rope, tie_word_embeddings=False)


def build(name: str, out_dir: str, seed: int = 0) -> dict:
  """Writes fixture ``name`` into ``out_dir``; returns ``{'tokens', 'logits'}`` (numpy)."""
  import torch
  import transformers

  llama = name.startswith("llama")
  tokenizer = _tokenizer("</s>" if llama else "<|endoftext|>", "<s>" if llama else None)
  eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
  bos_id = tokenizer.convert_tokens_to_ids(tokenizer.bos_token) if llama else eos_id
  torch.manual_seed(seed)
  config = _config(name, len(tokenizer), eos_id, bos_id)
  config._attn_implementation = "eager"
  net = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():  # every parameter random: a misplaced bias or scale changes the logits
    for pname, p in net.named_parameters():
      p.copy_(
        torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.15)
        + (1.0 if "norm" in pname or "ln" in pname else 0.0)
      )
  dtype = torch.bfloat16 if name == "llama" else torch.float32
  shard = "100KB" if name == "gpt_neo" else "1GB"
  net.to(dtype).save_pretrained(out_dir, max_shard_size=shard)
  tokenizer.save_pretrained(out_dir)
  first = tokenizer(TEXT, add_special_tokens=False).input_ids[:SEQ]
  rng = np.random.default_rng(seed)
  tokens = np.stack([np.asarray(first), rng.integers(0, len(tokenizer), SEQ)]).astype(np.int32)
  # the reference is the directory as transformers reads it, in float32 (not `net`, whose
  # non-persistent buffers, such as RoPE's frequencies, were rounded to bfloat16 with it)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(
    out_dir, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  with torch.no_grad():
    logits = loaded(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
  np.savez(os.path.join(out_dir, "reference.npz"), tokens=tokens, logits=logits.astype(np.float32))
  with open(os.path.join(out_dir, "reference.json"), "w") as f:
    json.dump({"transformers": transformers.__version__, "torch": torch.__version__}, f)
  return {"tokens": tokens, "logits": logits}


def main(argv) -> None:
  os.makedirs(FIXTURES, exist_ok=True)
  for name in argv[1:] or NAMES:
    target = os.path.join(FIXTURES, name)
    with tempfile.TemporaryDirectory(dir=FIXTURES) as tmp:
      build(name, tmp)
      if os.path.isdir(target):
        for f in os.listdir(target):
          os.remove(os.path.join(target, f))
        os.rmdir(target)
      os.chmod(tmp, 0o755)
      os.rename(tmp, target)
      os.makedirs(tmp)  # TemporaryDirectory removes it on exit
    print(name, sorted(os.listdir(target)))


if __name__ == "__main__":
  main(sys.argv)
