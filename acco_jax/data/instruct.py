"""Instruction data: examples of a prompt and a response, as text pieces that are trained on or not.

An example is a list of ``(text, trained)`` pieces (:class:`Example`): the prompt's pieces are not
trained on, the response's are, and the tokenizer's end-of-text after each trained response counts
as part of it (the model learns to stop). Sources (``data.source``):

* ``jsonl:<path or glob>`` (JSON lines, or a file holding one JSON array of records, as Alpaca's
  ``alpaca_data.json``) with ``data.format``:

  - ``alpaca``: ``{"instruction", "input" (optional), "output"}``, rendered with the Alpaca prompt
    template (:func:`alpaca_prompt`);
  - ``prompt_completion``: ``{"prompt", "completion"}``, the prompt as it is;
  - ``chat``: ``{"messages": [{"role": "system" | "user" | "assistant", "content"}, ...]}``: every
    assistant message is trained on. Rendered with the built-in template (:data:`CHAT_TEMPLATE`),
    or with a Hugging Face tokenizer's own chat template (``data.chat_template=hf``,
    :mod:`acco_jax.data.chat`): its assistant turns are trained on, each closed by the template's
    end-of-turn token, whether the template marks them with ``{% generation %}`` or not.

* ``instruct:embedded``: the built-in set, derived from the embedded King James Bible (public
  domain; :func:`embedded_examples`): for each of a fixed, seeded sample of verses, "Which book is
  this verse from?" (66 answers), "What is the first word of this verse?" and "What is the last
  word ...?" (copies from the verse), answers a person can check and a small model learns.

Errors in a file are one line naming the file and line (a line that is not JSON, a field missing
or of the wrong type, an empty response).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sqlite3
from typing import NamedTuple

import numpy as np

from acco_jax import errors
from acco_jax.data import chat, sources

FORMATS = ("alpaca", "prompt_completion", "chat")
ROLES = ("system", "user", "assistant")


class Example(NamedTuple):
  """One example as text pieces; ``answer`` is the reference an exact-match evaluation compares
  the model's greedy reply with (the last trained piece, less its end-of-turn text)."""

  pieces: tuple[tuple[str, bool], ...]  # (text, trained), in order
  # a chat template's rendering: tokenized as one text with the tokenizer's special tokens, and
  # closed by the template's own end-of-turn token (no end-of-text appended)
  rendered: bool = False
  end_of_turn: str = ""  # the text that closes each trained turn ('' for the end-of-text)

  @property
  def prompt(self) -> str:
    """Everything before the last trained piece (what a reply is generated after)."""
    last = max(i for i, (_, trained) in enumerate(self.pieces) if trained)
    return "".join(text for text, _ in self.pieces[:last])

  @property
  def answer(self) -> str:
    text = next(text for text, trained in reversed(self.pieces) if trained)
    return text.removesuffix(self.end_of_turn) if self.end_of_turn else text


# -- templates -------------------------------------------------------------------------------------

_ALPACA_INPUT = (
  "Below is an instruction that describes a task, paired with an input that provides further "
  "context. Write a response that appropriately completes the request.\n\n"
  "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
_ALPACA = (
  "Below is an instruction that describes a task. Write a response that appropriately completes "
  "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def alpaca_prompt(instruction: str, input_text: str = "") -> str:
  """The Alpaca prompt (Taori et al., 2023): with an input section when there is one."""
  if input_text:
    return _ALPACA_INPUT.format(instruction=instruction, input=input_text)
  return _ALPACA.format(instruction=instruction)


# The built-in chat template: each message as '<|role|>\n' and its content; an assistant's content
# (trained on) follows '<|assistant|>\n' and is closed by the tokenizer's end-of-text.
CHAT_TEMPLATE = "<|{role}|>\n{content}\n"


def chat_pieces(messages: list[dict]) -> tuple[tuple[str, bool], ...]:
  """The built-in template's pieces: every assistant message trained on (its end-of-text is
  added when the example is encoded), everything else not."""
  pieces = []
  for m in messages:
    if m["role"] == "assistant":
      pieces.append(("<|assistant|>\n", False))
      pieces.append((m["content"], True))
    else:
      pieces.append((CHAT_TEMPLATE.format(role=m["role"], content=m["content"]), False))
  return tuple(pieces)


# -- reading JSONL -----------------------------------------------------------------------------------


def _field(record: dict, key: str, where: str, optional: bool = False) -> str:
  value = record.get(key)
  if value is None and optional:
    return ""
  if not isinstance(value, str):
    got = "missing" if key not in record else f"a {type(value).__name__}"
    raise errors.UserValueError(f"{where}: field {key!r} is {got}, not a string")
  return value


def _example(record, fmt: str, where: str, template: chat.Template | None) -> Example:
  if not isinstance(record, dict):
    raise errors.UserValueError(f"{where}: a {type(record).__name__}, not a JSON object")
  if fmt == "alpaca":
    prompt = alpaca_prompt(
      _field(record, "instruction", where), _field(record, "input", where, optional=True)
    )
    pieces = ((prompt, False), (_field(record, "output", where), True))
  elif fmt == "prompt_completion":
    pieces = ((_field(record, "prompt", where), False), (_field(record, "completion", where), True))
  else:
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
      raise errors.UserValueError(f"{where}: field 'messages' is missing or not a list")
    for m in messages:
      if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise errors.UserValueError(
          f"{where}: a message without a role of {', '.join(ROLES)}: {json.dumps(m)[:80]}"
        )
      _field(m, "content", where)
    if not any(m["role"] == "assistant" for m in messages):
      raise errors.UserValueError(f"{where}: no assistant message to train on")
    if template is not None:
      pieces = chat.pieces(template, messages, where)
      last = next((text for text, trained in reversed(pieces) if trained), "")
      _check_trained(pieces, where)
      return Example(pieces, rendered=True, end_of_turn=chat.end_of_turn(template, last))
    pieces = chat_pieces(messages)
  _check_trained(pieces, where)
  return Example(pieces)


def _check_trained(pieces, where: str) -> None:
  if not any(trained and text.strip() for text, trained in pieces):
    raise errors.UserValueError(f"{where}: the response is empty (nothing to train on)")


def jsonl_files(pattern: str) -> list[str]:
  expanded = os.path.expanduser(pattern)
  files = sorted(glob.glob(expanded, recursive=True)) if glob.has_magic(expanded) else [expanded]
  files = [f for f in files if os.path.isfile(f)]
  if not files:
    raise errors.UserFileNotFoundError(
      f"data.source=jsonl:{pattern}: no such file (one JSON object per line)"
    )
  return files


def read_jsonl(pattern: str, fmt: str, template: chat.Template | None = None) -> list[Example]:
  """The examples of every line of the files ``pattern`` names (blank lines skipped)."""
  if fmt not in FORMATS:
    raise errors.UserValueError(
      f"data.format={fmt!r} is unknown: choose one of {', '.join(FORMATS)}"
    )
  out = []
  for path in jsonl_files(pattern):
    with open(path, encoding="utf-8") as f:
      text = f.read()
    if text.lstrip().startswith("["):  # one JSON array (Alpaca's alpaca_data.json)
      try:
        records = json.loads(text)
      except json.JSONDecodeError as e:
        raise errors.UserValueError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
      out += [_example(r, fmt, f"{path}: record {i}", template) for i, r in enumerate(records)]
      continue
    for number, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      where = f"{path}:{number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise errors.UserValueError(f"{where}: not a JSON object ({e.msg})") from None
      out.append(_example(record, fmt, where, template))
  if not out:
    raise errors.UserValueError(f"data.source=jsonl:{pattern}: the files hold no example")
  return out


# -- the embedded set ------------------------------------------------------------------------------

EMBEDDED = "instruct:embedded"
# The answer follows "Answer:" after a space, as a word follows another in running text (a BPE
# learnt on text has " Genesis" as a token, "Genesis" after a space-ended prompt rarely).
# The verse follows "Verse:" after a space too: its first word is then the same token as the
# answer that copies it.
_QUESTIONS = {
  "book": "Which book of the Bible is this verse from?\nVerse: {verse}\nAnswer:",
  "first": "What is the first word of this verse?\nVerse: {verse}\nAnswer:",
  "last": "What is the last word of this verse?\nVerse: {verse}\nAnswer:",
}


def _verses() -> list[tuple[str, str]]:
  """``(book name, verse text)`` of every verse of the embedded KJV, in order."""
  con = sqlite3.connect(f"{sources.kjv_path().as_uri()}?mode=ro", uri=True)
  try:
    rows = con.execute(
      "SELECT Books.ShortName, Bible.Passage1 FROM Bible JOIN Books ON "
      "Books.TestamentID = Bible.TestamentID AND Books.BookID = Bible.BookID "
      "ORDER BY Bible.TestamentID, Bible.BookID, Bible.ChapterID, Bible.VerseID"
    ).fetchall()
  finally:
    con.close()
  out = []
  for book, passage in rows:
    text = re.sub(r"^\s*\d+:\d+\s+", "", passage or "").strip()
    if text:
      out.append((book.strip(), text))
  return out


def _books() -> list[str]:
  """The 66 book names of the embedded KJV, in order."""
  con = sqlite3.connect(f"{sources.kjv_path().as_uri()}?mode=ro", uri=True)
  try:
    rows = con.execute("SELECT ShortName FROM Books ORDER BY TestamentID, BookID").fetchall()
  finally:
    con.close()
  return [name.strip() for (name,) in rows]


def embedded_examples(count: int = 4500, seed: int = 0) -> list[Example]:
  """``count`` examples of the built-in set, in a seeded order: a seeded sample of ``count // 3``
  verses, each asked for its book (66 answers: recall), its first word (a copy from the start of
  the verse) and its last word (a copy from its end), the same verses in the three tasks."""
  verses = _verses()
  rng = np.random.default_rng(seed)
  picked = rng.choice(len(verses), size=min(count // 3, len(verses)), replace=False)
  out = []
  for i in picked:
    book, verse = verses[i]
    words = re.findall(r"[A-Za-z']+", verse)
    for task, answer in (("book", book), ("first", words[0]), ("last", words[-1])):
      out.append(Example(((_QUESTIONS[task].format(verse=verse), False), (f" {answer}", True))))
  return [out[j] for j in rng.permutation(len(out))]


def load(source: str, fmt: str, template: chat.Template | None = None) -> list[Example]:
  """The examples of an instruction source (``jsonl:<glob>`` or ``instruct:embedded``)."""
  if source == EMBEDDED:
    return embedded_examples()
  if source.startswith("jsonl:") and len(source) > 6:
    return read_jsonl(source[6:], fmt, template)
  raise errors.UserValueError(
    f"data.source={source!r} is not instruction data: give jsonl:<path or glob> or {EMBEDDED}"
  )


def is_instruction_source(source: str) -> bool:
  return source == EMBEDDED or source.startswith("jsonl:")
