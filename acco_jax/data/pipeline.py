"""Token streams, packing into rows, and the shuffled, sharded, checkpointable batch iterator.

Token stream: the documents, each encoded as ordinary text and followed by the tokenizer's
end-of-text id (``doc0 eot doc1 eot ...``), as a flat int32 array.

Rows: the stream cut into consecutive, non-overlapping rows of ``seq_len + 1`` tokens (the tail
that does not fill a row is dropped); a row gives ``inputs = row[:-1]`` and ``targets = row[1:]``.
Rows cross document boundaries; the eot token marks them.

Batches: rows are shuffled with a grain index shuffle from `seed` (a new permutation every epoch)
and repeated. Global batch ``s`` is positions ``[s*G, (s+1)*G)`` of that sequence
(``G = global_batch_rows``); process ``p`` of ``P`` gets the ``p``-th consecutive block of ``G/P``
rows, so concatenating the processes' batches in process order gives the global batch. The
iterator state is the global step, so a checkpoint restores on any process count.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import uuid
from collections.abc import Sequence

import grain
import numpy as np
from absl import logging

from acco_jax import errors
from acco_jax.data import sources
from acco_jax.data.tokenizer import Tokenizer, default_cache_dir, get_tokenizer

_CACHE_VERSION = 1
_ENCODE_CHUNK = 1024  # documents per encode_batch call


@dataclasses.dataclass(frozen=True)
class TokenData:
  """Token streams of a source (1-D int32 arrays, documents separated by `tokenizer.eot_id`)."""

  train: np.ndarray  # int32[n_train_tokens]
  eval: np.ndarray  # int32[n_eval_tokens]; documents disjoint from train's
  tokenizer: Tokenizer
  source: str


def encode_documents(tokenizer: Tokenizer, docs: Sequence[str]) -> np.ndarray:
  """The token stream of `docs`: each document's ids followed by `tokenizer.eot_id` (int32)."""
  eot = np.array([tokenizer.eot_id], np.int32)
  parts = []
  for start in range(0, len(docs), _ENCODE_CHUNK):
    for ids in tokenizer.encode_batch(docs[start : start + _ENCODE_CHUNK]):
      parts.append(np.asarray(ids, np.int32))
      parts.append(eot)
  return np.concatenate(parts) if parts else np.zeros([0], np.int32)


def split_documents(
  docs: Sequence[str], eval_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
  """Holds out ``round(eval_fraction * len(docs))`` documents (at least one if the fraction > 0).

  The held-out documents are drawn with `seed`; both parts keep the source order.
  """
  if not 0.0 <= eval_fraction < 1.0:
    raise errors.UserValueError(f"eval_fraction={eval_fraction} must be in [0, 1)")
  n_eval = max(1, round(eval_fraction * len(docs))) if eval_fraction > 0 else 0
  if n_eval >= len(docs):
    raise errors.UserValueError(
      f"cannot hold out {n_eval} of {len(docs)} document(s) for eval: use a source with more "
      "documents (text: paragraphs are separated by blank lines) or eval_fraction=0"
    )
  held_out = np.zeros(len(docs), bool)
  held_out[np.random.default_rng(seed).permutation(len(docs))[:n_eval]] = True
  train = [d for d, h in zip(docs, held_out, strict=True) if not h]
  return train, [d for d, h in zip(docs, held_out, strict=True) if h]


def prepare(
  source: str = "embedded",
  tokenizer: str | Tokenizer = "byte",
  *,
  cache_dir: str | None = None,
  eval_fraction: float = 0.05,
  seed: int = 0,
  data_dir: str | None = None,
  text_key: str = "text",
  download: bool = True,
) -> TokenData:
  """Loads `source`, splits off eval documents, tokenizes once and caches the streams as .npy.

  The cache key covers the source (for ``text:``, file sizes and mtimes), the tokenizer,
  `eval_fraction` and `seed`; a hit loads ``<cache_dir>/tokens/<key>.{train,eval}.npy``
  memory-mapped without reading the source.

  Args:
    source: see `sources.load_documents`.
    tokenizer: a `Tokenizer` or a name for `get_tokenizer`; ``bpe:<n>`` trains on the train split.
    cache_dir: cache root (default ``$ACCO_JAX_CACHE`` or ``~/.cache/acco_jax``).
    eval_fraction: fraction of documents held out for eval.
    seed: chooses the held-out documents.
    data_dir: ``text:``: where prepared array_record files go (default ``<cache_dir>/text_tfds``);
      ``tfds:``: the TFDS data directory.
    text_key: ``tfds:`` only: the text feature.
    download: ``tfds:`` only: allow downloading and preparing the dataset.

  Returns:
    A `TokenData`.
  """
  cache_dir = default_cache_dir(cache_dir)
  if source.startswith("text:"):
    data_dir = data_dir or os.path.join(cache_dir, "text_tfds")
  tok_key = tokenizer if isinstance(tokenizer, str) else tokenizer.fingerprint
  fingerprint = sources.source_fingerprint(source, data_dir=data_dir, text_key=text_key)
  key_src = json.dumps([_CACHE_VERSION, fingerprint, tok_key, eval_fraction, seed])
  stem = os.path.join(cache_dir, "tokens", hashlib.sha256(key_src.encode()).hexdigest()[:16])
  paths = {split: f"{stem}.{split}.npy" for split in ("train", "eval")}
  meta_path = f"{stem}.json"

  if os.path.isfile(meta_path) and all(os.path.isfile(p) for p in paths.values()):
    with open(meta_path) as f:
      meta = json.load(f)
    try:
      tok = tokenizer if isinstance(tokenizer, Tokenizer) else get_tokenizer(meta["tokenizer"])
    except FileNotFoundError:  # a trained BPE file was deleted: rebuild everything
      tok = None
    if tok is not None:
      logging.info("prepare: loading cached tokens %s.*", stem)
      streams = {s: np.load(p, mmap_mode="r") for s, p in paths.items()}
      return TokenData(streams["train"], streams["eval"], tok, source)

  docs = sources.load_documents(source, data_dir=data_dir, text_key=text_key, download=download)
  train_docs, eval_docs = split_documents(docs, eval_fraction, seed)
  if isinstance(tokenizer, str):
    tok = get_tokenizer(tokenizer, cache_dir=cache_dir, train_text=train_docs)
  else:
    tok = tokenizer
  streams = {"train": encode_documents(tok, train_docs), "eval": encode_documents(tok, eval_docs)}
  os.makedirs(os.path.dirname(stem), exist_ok=True)
  for split, path in paths.items():
    tmp = f"{path}.{uuid.uuid4().hex}.npy"  # unique per writer, also across hosts
    np.save(tmp, streams[split])
    os.replace(tmp, path)
  meta = {
    "source": source,
    "tokenizer": tok.name,
    "vocab_size": tok.vocab_size,
    "documents": {"train": len(train_docs), "eval": len(eval_docs)},
    "tokens": {s: int(a.size) for s, a in streams.items()},
  }
  tmp = f"{meta_path}.{uuid.uuid4().hex}"
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=1)
  os.replace(tmp, meta_path)  # written last: its presence means the .npy files are complete
  logging.info("prepare: %s", meta)
  return TokenData(streams["train"], streams["eval"], tok, source)


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
  """Cuts `tokens` into consecutive rows ``[n_rows, seq_len + 1]`` (a view; the tail is dropped)."""
  if seq_len < 1:
    raise ValueError(f"seq_len={seq_len} must be >= 1")
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    raise ValueError(f"expected a 1-D token stream, got shape {tokens.shape}")
  n_rows = tokens.size // (seq_len + 1)
  return tokens[: n_rows * (seq_len + 1)].reshape(n_rows, seq_len + 1)


def _to_example(rows: np.ndarray, indices: np.ndarray) -> dict[str, np.ndarray]:
  rows = np.asarray(rows[indices], np.int32)
  return {
    "inputs": np.ascontiguousarray(rows[:, :-1]),
    "targets": np.ascontiguousarray(rows[:, 1:]),
  }


class BatchIterator:
  """Iterator of per-process batches ``{'inputs': int32[b, L], 'targets': int32[b, L]}``.

  Random access underneath (a `grain.MapDataset`), so the position is just the global step:
  `get_state` returns a small JSON-able dict and `set_state` jumps to it. The state is the same on
  every process and does not depend on the process count.
  """

  def __init__(self, dataset: grain.MapDataset, config: dict, num_steps: int | None):
    self._dataset = dataset
    self._config = config
    self._num_steps = num_steps  # None: infinite
    self._step = 0

  @property
  def step(self) -> int:
    """Number of batches taken so far (the global step)."""
    return self._step

  def __iter__(self) -> BatchIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._num_steps is not None and self._step >= self._num_steps:
      raise StopIteration
    batch = self._dataset[self._step]
    self._step += 1
    return batch

  def __len__(self) -> int:
    if self._num_steps is None:
      raise TypeError("this iterator repeats forever (num_epochs=None) and has no length")
    return self._num_steps

  def get_state(self) -> dict:
    """The position: ``{'step': int, ...config}``, JSON-able."""
    return {"step": self._step, **self._config}

  def set_state(self, state: dict) -> None:
    """Continues from `state` (from `get_state` of an iterator over the same data and config)."""
    differing = {k: (state.get(k), v) for k, v in self._config.items() if state.get(k) != v}
    if differing:
      raise errors.UserValueError(
        f"the saved data position is for another stream, {differing} (saved, current): continue "
        "with the same data, seq_len, batch size and seed (data.*, batch.*, train.seed), or start "
        "in a new directory"
      )
    self._step = int(state["step"])


def data_state(saved: dict, global_batch_rows: int) -> dict:
  """A data-iterator position (``BatchIterator.get_state``) carried over to another global batch.

  Global batch ``s`` is positions ``[s*G, (s+1)*G)`` of the seeded, shuffled, repeated sequence of
  rows (:func:`batches`), so the saved position has consumed ``step * G_old`` rows.
  The new iterator continues with the same shuffle at the first batch of ``G_new`` rows that starts
  at or after that position: exactly there when ``G_new`` divides it (e.g. halving the devices),
  otherwise it skips fewer than ``G_new`` rows; no row is seen twice within an epoch.
  """
  consumed = int(saved["step"]) * int(saved["global_batch_rows"])
  rows = int(global_batch_rows)
  return {**saved, "step": -(-consumed // rows), "global_batch_rows": rows}


def batches(
  tokens: np.ndarray,
  *,
  seq_len: int,
  global_batch_rows: int,
  seed: int = 0,
  process_index: int = 0,
  process_count: int = 1,
  shuffle: bool = True,
  num_epochs: int | None = None,
) -> BatchIterator:
  """Shuffled batches of packed rows of a token stream, this process's share of each global batch.

  Args:
    tokens: a token stream (`TokenData.train` or `TokenData.eval`).
    seq_len: L, tokens per example; rows hold L + 1 tokens.
    global_batch_rows: G, rows per global batch (over all processes).
    seed: shuffle seed (each epoch gets its own permutation).
    process_index: this process, in ``[0, process_count)``.
    process_count: number of processes; must divide G.
    shuffle: shuffle rows (False: stream order, e.g. for eval).
    num_epochs: passes over the rows; None repeats forever. The last partial global batch of a
      finite run is dropped, so every process gets the same number of batches.

  Returns:
    A `BatchIterator` yielding ``G // process_count`` rows per batch.
  """
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
  if global_batch_rows < 1 or global_batch_rows % process_count:
    raise ValueError(
      f"global_batch_rows={global_batch_rows} must be a positive multiple of "
      f"process_count={process_count}"
    )
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs={num_epochs} must be >= 1 or None (repeat forever)")
  rows = pack(tokens, seq_len)
  if len(rows) < global_batch_rows:
    raise errors.UserValueError(
      f"a stream of {np.size(tokens)} tokens packs into {len(rows)} rows of seq_len+1="
      f"{seq_len + 1}, fewer than global_batch_rows={global_batch_rows}: lower seq_len or "
      "global_batch_rows, or use a larger corpus"
    )
  local_rows = global_batch_rows // process_count
  ds = grain.MapDataset.range(len(rows))  # row indices; rows are gathered per batch
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)  # a new permutation each epoch
  ds = ds.batch(local_rows, drop_remainder=True)  # block k = rows [k*b, (k+1)*b)
  num_steps = None
  if num_epochs is not None:
    num_steps = len(rows) * num_epochs // global_batch_rows
    ds = ds[: num_steps * process_count]
  # Global step s = blocks [s*P, (s+1)*P); this process takes block s*P + process_index.
  ds = ds[process_index::process_count].map(functools.partial(_to_example, rows))
  config = {
    "num_rows": len(rows),
    "seq_len": seq_len,
    "global_batch_rows": global_batch_rows,
    "seed": seed,
    "shuffle": shuffle,
    "num_epochs": num_epochs,
  }
  return BatchIterator(ds, config, num_steps)


def unigram_entropy(tokens: np.ndarray) -> float:
  """Entropy (nats/token) of the tokens' empirical unigram distribution: the unigram-model loss."""
  counts = np.bincount(np.asarray(tokens).ravel())
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())
