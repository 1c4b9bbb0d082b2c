"""A TFDS builder that turns local text files into an array_record dataset of paragraphs.

Documents are **paragraphs**: runs of lines separated by one or more blank (or whitespace-only)
lines, with their inner newlines kept. Files are read as UTF-8 (undecodable bytes become U+FFFD) in
the order given, and the dataset keeps that order (``disable_shuffling=True``). A file without blank
lines is a single document. The builder writes ``file_format='array_record'``, which needs no
TensorFlow; read it back with ``builder.as_data_source('train')`` (``ds[i] == {'text': b'...'}``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import tensorflow_datasets as tfds

_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t\f\v]*\n)+")


def split_paragraphs(text: str) -> list[str]:
  """Splits `text` at blank lines; drops empty paragraphs and the newlines around each one."""
  text = text.replace("\r\n", "\n").replace("\r", "\n")
  paragraphs = (p.strip("\n") for p in _PARAGRAPH_BREAK.split(text))
  return [p for p in paragraphs if p.strip()]


class LocalText(tfds.core.GeneratorBasedBuilder):
  """Paragraphs of local text files as a one-split (``train``) TFDS dataset.

  Build with ``LocalText(paths=[...], data_dir=D, file_format='array_record')`` and call
  ``download_and_prepare()`` (nothing is downloaded). Use one `data_dir` per set of files: the
  prepared dataset does not record which files it came from.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Paragraphs of local text files."}

  def __init__(self, *, paths: Sequence[str] = (), **kwargs):
    self._paths = tuple(str(p) for p in paths)
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo directly: `dataset_info_from_configs` looks for package metadata files.
    return tfds.core.DatasetInfo(
      builder=self,
      description="Paragraphs of local text files, in file order.",
      features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
      disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # local files only
    return {"train": self._generate_examples()}

  def _generate_examples(self) -> Iterator[tuple[int, dict[str, str]]]:
    key = 0
    for path in self._paths:
      with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
      for paragraph in split_paragraphs(text):
        yield key, {"text": paragraph}
        key += 1
