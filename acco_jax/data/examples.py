"""Tokenized instruction examples, and their batches: packed rows, or one example a row in buckets.

:func:`encode` turns :class:`acco_jax.data.instruct.Example` s into :class:`Examples`: each example's
ids (its pieces encoded one after another, then the tokenizer's end-of-text) and a flag per id,
whether it is trained on (a response's ids and the end-of-text after it). An example of ``n`` ids
gives ``n - 1`` positions: ``inputs = ids[:-1]``, ``targets = ids[1:]``, ``weights = trained[1:]``
(the loss is on the response's tokens only).

Batches (:func:`batches`), two ways:

* ``packing=True``: examples are packed in order into rows of ``seq_len`` positions (first fit:
  the next example goes into the current row if it fits, else a new row starts); each row carries
  ``segments`` (1, 2, ... per example, 0 for padding) and ``positions`` (restarting at 0 for each
  example), so that attention never crosses an example and positions are each example's own
  (:mod:`acco_jax.models.base`). Rows are then shuffled and batched as the token rows of
  :func:`acco_jax.data.batches` are.
* ``packing=False``: one example per row, the examples shuffled; each global batch is padded to
  the smallest multiple of ``bucket`` that holds its longest example (at most ``seq_len``), so a
  batch costs about its longest example, as the ACCO paper pads its mini-batches, and one compiled
  program serves each bucket (at most ``ceil(seq_len / bucket)`` of them). Every process computes
  the bucket from the whole global batch's lengths, so all processes agree.

An example longer than ``seq_len + 1`` ids is truncated to its first ``seq_len + 1`` (the start of
its response is kept: the paper's 512-token cut); one whose prompt alone fills that has nothing
left to train on and is dropped. :func:`truncation` counts both (the run logs them). Padding
weighs 0.

The iterator's state is the global step, as :class:`acco_jax.data.BatchIterator`'s: a resumed run
reads the same batches, bucket for bucket.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import grain
import numpy as np

from acco_jax import errors
from acco_jax.data.instruct import Example
from acco_jax.data.pipeline import BatchIterator
from acco_jax.data.tokenizer import Tokenizer


class Examples(NamedTuple):
  """Tokenized examples, flat: example ``i`` is ``ids[offsets[i]:offsets[i + 1]]``."""

  ids: np.ndarray  # int32 [total]
  trained: np.ndarray  # bool [total]: the id is a response's (or the end-of-text after it)
  offsets: np.ndarray  # int64 [n + 1]

  def __len__(self) -> int:
    return len(self.offsets) - 1

  @property
  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)

  def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = self.offsets[i], self.offsets[i + 1]
    return self.ids[a:b], self.trained[a:b]

  def trained_targets(self) -> np.ndarray:
    """Every id a loss is taken on (the unigram baseline of the responses)."""
    starts = np.zeros(len(self.ids), bool)
    starts[self.offsets[:-1]] = True  # an example's first id is never a target
    return self.ids[self.trained & ~starts]


def _rendered(tokenizer: Tokenizer, examples: Sequence[Example]) -> dict[int, tuple]:
  """The ids and trained flags of the examples a chat template rendered: each tokenized as one
  text (special tokens as their ids), an id trained where any of its characters is (as
  transformers' ``return_assistant_tokens_mask``: a token that straddles the start of a turn is
  the turn's)."""
  picked = [i for i, ex in enumerate(examples) if ex.rendered]
  if not picked:
    return {}
  texts = ["".join(text for text, _ in examples[i].pieces) for i in picked]
  out = {}
  for i, (ids, spans) in zip(picked, tokenizer.encode_rendered(texts), strict=True):
    chars = np.concatenate([np.full(len(t), f, bool) for t, f in examples[i].pieces] + [[False]])
    before = np.concatenate([[0], np.cumsum(chars)])  # trained characters before each offset
    start, end = np.asarray(spans, np.int64).reshape(-1, 2).T
    trained = (before[np.maximum(end, start + 1)] - before[start]) > 0  # empty span: its char
    out[i] = (np.asarray(ids, np.int32), trained)
  return out


def encode(tokenizer: Tokenizer, examples: Sequence[Example]) -> Examples:
  """Each example's pieces encoded as ordinary text, one after another, and the end-of-text
  (trained on when the example ends with a response); a chat template's rendering as one text
  that its own end-of-turn tokens close (:func:`_rendered`)."""
  rendered = _rendered(tokenizer, examples)
  plain = [text for ex in examples if not ex.rendered for text, _ in ex.pieces]
  encoded = iter(tokenizer.encode_batch(plain))
  ids, trained, offsets = [], [], [0]
  for i, ex in enumerate(examples):
    if ex.rendered:
      ids.append(rendered[i][0])
      trained.append(rendered[i][1])
      offsets.append(offsets[-1] + len(rendered[i][0]))
      continue
    n = 0
    for _, flag in ex.pieces:
      piece = np.asarray(next(encoded), np.int32)
      ids.append(piece)
      trained.append(np.full(piece.shape, flag))
      n += len(piece)
    ids.append(np.array([tokenizer.eot_id], np.int32))
    trained.append(np.array([ex.pieces[-1][1]]))
    offsets.append(offsets[-1] + n + 1)
  flat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
  mask = np.concatenate(trained) if trained else np.zeros(0, bool)
  return Examples(flat, mask, np.asarray(offsets, np.int64))


def truncation(examples: Examples, seq_len: int) -> tuple[int, int]:
  """``(truncated, dropped)``: examples longer than ``seq_len + 1`` ids, and those of them with
  no trained target left in the first ``seq_len + 1``."""
  long = np.flatnonzero(examples.lengths > seq_len + 1)
  dropped = sum(not _usable(*examples.example(i), seq_len) for i in long)
  return len(long), dropped


def _usable(ids, trained, seq_len) -> bool:
  return bool(np.any(trained[1 : seq_len + 1]))


def _positions(examples: Examples, seq_len: int) -> list[int]:
  """The examples that keep a trained target after truncation."""
  return [i for i in range(len(examples)) if _usable(*examples.example(i), seq_len)]


def _row(examples: Examples, members: Sequence[int], width: int, packed: bool) -> dict:
  """One row of ``width`` positions holding ``members`` (one unless packed)."""
  row = {
    "inputs": np.zeros(width, np.int32),
    "targets": np.zeros(width, np.int32),
    "weights": np.zeros(width, np.float32),
  }
  if packed:
    row["segments"] = np.zeros(width, np.int32)
    row["positions"] = np.zeros(width, np.int32)
  at = 0
  for segment, i in enumerate(members, 1):
    ids, trained = examples.example(i)
    n = min(len(ids) - 1, width - at)
    row["inputs"][at : at + n] = ids[:n]
    row["targets"][at : at + n] = ids[1 : n + 1]
    row["weights"][at : at + n] = trained[1 : n + 1]
    if packed:
      row["segments"][at : at + n] = segment
      row["positions"][at : at + n] = np.arange(n)
    at += n
  return row


def pack(examples: Examples, seq_len: int) -> list[list[int]]:
  """The examples of each packed row, first fit in order (see the module docstring)."""
  rows, used = [], seq_len
  for i in _positions(examples, seq_len):
    n = min(int(examples.lengths[i]) - 1, seq_len)
    if used + n > seq_len:
      rows.append([])
      used = 0
    rows[-1].append(i)
    used += n
  return rows


def bucket_of(length: int, bucket: int, seq_len: int) -> int:
  """The width of a batch whose longest example has ``length`` positions."""
  return min(seq_len, -(-length // bucket) * bucket)


class _Rows:
  """Global batch ``s``'s rows for this process, from its row units (packed rows or examples) of
  every process (a grain map function)."""

  def __init__(self, examples, members, local_rows, process_index, width_of, packed):
    self.examples, self.members, self.packed = examples, members, packed
    self.local, self.index, self.width_of = local_rows, process_index, width_of

  def __call__(self, units) -> dict:
    units = np.asarray(units)
    width = self.width_of(units)  # from the whole global batch: every process agrees
    mine = units[self.index * self.local : (self.index + 1) * self.local]
    rows = [_row(self.examples, self.members[u], width, self.packed) for u in mine]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def batches(
  examples: Examples,
  *,
  seq_len: int,
  global_batch_rows: int,
  seed: int = 0,
  process_index: int = 0,
  process_count: int = 1,
  shuffle: bool = True,
  num_epochs: int | None = None,
  packing: bool = False,
  bucket: int = 64,
) -> BatchIterator:
  """Batches of the examples (see the module docstring): ``{'inputs', 'targets', 'weights'}``
  (and, packed, ``'segments'``, ``'positions'``) of ``[global_batch_rows // process_count, W]``,
  ``W = seq_len`` packed, a bucket otherwise."""
  if global_batch_rows < 1 or global_batch_rows % process_count:
    raise ValueError(
      f"global_batch_rows={global_batch_rows} must be a positive multiple of "
      f"process_count={process_count}"
    )
  if bucket < 1:
    raise errors.UserValueError(f"data.bucket={bucket} must be >= 1 (positions per bucket step)")
  members = pack(examples, seq_len) if packing else [[i] for i in _positions(examples, seq_len)]
  if len(members) < global_batch_rows:
    unit = "packed rows" if packing else "examples"
    _, dropped = truncation(examples, seq_len)
    why = f" ({dropped} of {len(examples)} dropped: their prompt alone fills it)" if dropped else ""
    raise errors.UserValueError(
      f"the instruction data gives {len(members)} {unit} of data.seq_len={seq_len}{why}, fewer "
      f"than one global batch of {global_batch_rows} rows: use more or shorter examples, a "
      "longer data.seq_len, or fewer devices or rows per microbatch"
    )
  lengths = np.asarray([min(int(examples.lengths[m[0]]) - 1, seq_len) for m in members])
  if packing:
    width_of = lambda units: seq_len
  else:
    width_of = lambda units: bucket_of(int(lengths[units].max()), bucket, seq_len)
  ds = grain.MapDataset.range(len(members))
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs).batch(global_batch_rows, drop_remainder=True)
  num_steps = None
  if num_epochs is not None:
    num_steps = len(members) * num_epochs // global_batch_rows
    ds = ds[:num_steps]
  local = global_batch_rows // process_count
  ds = ds.map(_Rows(examples, members, local, process_index, width_of, packing))
  config = {
    "num_rows": len(members),
    "seq_len": seq_len,
    "global_batch_rows": global_batch_rows,
    "seed": seed,
    "shuffle": shuffle,
    "num_epochs": num_epochs,
    "packing": packing,
    "bucket": bucket if not packing else 0,
  }
  return BatchIterator(ds, config, num_steps)


class InstructData(NamedTuple):
  """An instruction source's examples, split and tokenized (:func:`prepare`); the trainer reads it
  where it reads a :class:`acco_jax.data.TokenData`."""

  train: Examples
  eval: Examples
  tokenizer: Tokenizer
  source: str
  answers: tuple[tuple[str, str], ...]  # the held-out examples' (prompt, answer), in order
  stop_ids: tuple[int, ...] = ()  # what ends a greedy reply: end-of-text, a template's end-of-turn


def template_of(tokenizer: Tokenizer, chat_template: str):
  """The chat template ``data.chat_template`` names (:class:`acco_jax.data.chat.Template`): None
  for the built-in one."""
  from acco_jax.data import chat

  if chat_template == "builtin":
    return None
  if chat_template != "hf":
    raise errors.UserValueError(
      f"data.chat_template={chat_template!r}: choose builtin or hf (the tokenizer's own)"
    )
  template = None
  if tokenizer.name.startswith("hf:"):
    template = chat.read(os.path.dirname(tokenizer.path), tokenizer.special_tokens())
  if template is None:
    raise errors.UserValueError(
      f"data.chat_template=hf: the tokenizer {tokenizer.name} has no chat template (neither "
      f"{chat.TEMPLATE_FILE} nor a chat_template in {chat.SETTINGS_FILE}): use "
      "data.chat_template=builtin"
    )
  return template


def stop_ids(tokenizer: Tokenizer, examples: Sequence[Example]) -> tuple[int, ...]:
  """The ids a greedy reply stops at: the end-of-text and each end-of-turn token of a chat
  template the examples were rendered with."""
  ends = sorted({ex.end_of_turn for ex in examples if ex.end_of_turn})
  ids = [tokenizer.eot_id]
  for got, _ in tokenizer.encode_rendered(ends) if ends else []:
    ids += got if len(got) == 1 and got[0] not in ids else []
  return tuple(ids)


def turn_end_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
  """The ids a reply stops at under the tokenizer's own chat template, if it has one: the
  end-of-text and the end-of-turn token the template closes an assistant turn with."""
  from acco_jax.data import chat

  if not tokenizer.name.startswith("hf:"):
    return (tokenizer.eot_id,)
  template = chat.read(os.path.dirname(tokenizer.path), tokenizer.special_tokens())
  if template is None:
    return (tokenizer.eot_id,)
  probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
  try:
    turn = [text for text, trained in chat.pieces(template, probe, "probe") if trained][-1]
  except (errors.UserValueError, IndexError):
    return (tokenizer.eot_id,)
  ex = Example(((turn, True),), rendered=True, end_of_turn=chat.end_of_turn(template, turn))
  return stop_ids(tokenizer, [ex])


def prepare(
  source: str,
  tokenizer: Tokenizer | str,
  *,
  fmt: str = "alpaca",
  chat_template: str = "builtin",
  eval_fraction: float = 0.05,
  seed: int = 0,
  cache_dir: str | None = None,
) -> InstructData:
  """Reads an instruction source (:func:`acco_jax.data.instruct.load`), holds out
  ``eval_fraction`` of its examples (drawn with ``seed``) and tokenizes both parts."""
  from acco_jax.data import instruct
  from acco_jax.data.pipeline import split_documents
  from acco_jax.data.tokenizer import get_tokenizer

  if (
    not isinstance(tokenizer, Tokenizer)
    and tokenizer.startswith("bpe:")
    and tokenizer[4:].isdigit()
  ):
    texts = [text for ex in instruct.load(source, fmt) for text, _ in ex.pieces]
    tokenizer = get_tokenizer(tokenizer, cache_dir=cache_dir, train_text=texts)
  elif not isinstance(tokenizer, Tokenizer):
    tokenizer = get_tokenizer(tokenizer, cache_dir=cache_dir)
  examples = instruct.load(source, fmt, template_of(tokenizer, chat_template))
  try:
    train, held_out = split_documents(examples, eval_fraction, seed)
  except errors.UserValueError:
    raise errors.UserValueError(
      f"data.source={source}: {len(examples)} example(s) leave none to hold out or none to "
      f"train on at data.eval_fraction={eval_fraction}: give more examples"
    ) from None
  if not held_out:
    raise errors.UserValueError(
      f"data.eval_fraction={eval_fraction} holds out no example of {source}: exact match and the "
      "held-out loss need some (e.g. 0.05)"
    )
  answers = tuple((ex.prompt, ex.answer) for ex in held_out)
  return InstructData(
    encode(tokenizer, train),
    encode(tokenizer, held_out),
    tokenizer,
    source,
    answers,
    stop_ids(tokenizer, examples),
  )


def loss_tokens(tokens) -> np.ndarray:
  """The ids a loss is taken on: a token stream's every id, examples' response ids."""
  return tokens.trained_targets() if isinstance(tokens, Examples) else np.asarray(tokens)


def prompt_ids(examples: Examples, i: int) -> np.ndarray:
  """Example ``i``'s ids before its last response (what a greedy reply is generated after)."""
  ids, trained = examples.example(i)
  starts = np.flatnonzero(trained & ~np.concatenate([[False], trained[:-1]]))
  return ids[: starts[-1]] if len(starts) else ids
