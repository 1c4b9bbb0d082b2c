"""Hugging Face checkpoints in and out: a local directory's ``config.json``, safetensors weights and
tokenizer, read into this project's model and written back.

Reading (:func:`model_config`, :func:`check_weights`, :func:`load_params`): ``config.json``'s
``model_type`` picks the architecture (``gpt2``, ``gpt_neo``, ``llama``) and its fields the sizes
(each architecture's ``from_hf_config``); the weights are ``model.safetensors`` or the shards a
``model.safetensors.index.json`` names, in float32, float16 or bfloat16. Each tensor is read on its
own, memory-mapped, converted to float32 into one new array (transposed for ``nn.Linear`` weights,
its vocabulary rows padded), and handed to ``place`` (the trainer puts it on its devices) before the
next: the host holds the placed parameters and one tensor at a time. Every tensor the architecture
needs must be there, with the shape ``config.json`` implies, and nothing else (apart from buffers
old versions saved, such as GPT-2's causal masks); names may come with or without the base model's
prefix (``transformer.``, ``model.``). All of it is checked from the files' headers before any
tensor is read, each tensor's bytes against the file's size (a file cut short by an interrupted
download is refused, not memory-mapped past its end). Buffers the architecture ignores
(``HF_IGNORED``) are set aside before the dtype check (old GPT-Neo uploads store BOOL causal
masks); a tied model whose file stores the head anyway (``HF_TIED_HEAD``) loads when that head
equals the embedding (compared, then ignored) and is refused in one line otherwise.

Writing (:func:`save`): ``config.json`` (the architecture's fields, ``model_type``,
``architectures``, the end-of-text id; a source directory's floats as it wrote them),
``generation_config.json`` (the end-of-text and end-of-turn ids as ``eos_token_id``), the weights
as safetensors (float32 or bfloat16; shards of at most ``shard_bytes`` with an index beyond it), a
tied head left out as transformers expects, and the tokenizer files (with its chat template). ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads it.

The safetensors format is read directly (an 8-byte header length, a JSON header, the raw
tensors): the library's NumPy reader has no bfloat16 and its Flax reader puts every tensor on the
default device. Writing uses ``safetensors.numpy``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from acco_jax import errors, models
from acco_jax.models.base import HFTensor, ModelConfig

CONFIG = "config.json"
GENERATION = "generation_config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
}
_SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _refuse(directory: str, message: str) -> errors.UserValueError:
  return errors.UserValueError(f"Hugging Face directory {directory}: {message}")


def is_hf_dir(path: str) -> bool:
  """Whether ``path`` is a directory holding a ``config.json``."""
  return os.path.isfile(os.path.join(path, CONFIG))


def read_config(directory: str) -> dict:
  """``config.json`` as a dict (one-line refusals: no directory, no file, not JSON)."""
  if not os.path.isdir(directory):
    raise errors.UserFileNotFoundError(
      f"Hugging Face directory {directory}: no such directory: give a local directory with "
      "config.json and model.safetensors (e.g. one written by save_pretrained)"
    )
  path = os.path.join(directory, CONFIG)
  if not os.path.isfile(path):
    raise _refuse(directory, "has no config.json: give the directory save_pretrained wrote")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise _refuse(directory, f"config.json is not readable JSON ({e})") from None


def architecture(hf: dict, directory: str) -> str:
  """The architecture of a ``config.json``, or the refusal naming the supported ``model_type``s."""
  model_type = hf.get("model_type")
  arch = models.by_hf_model_type(model_type)
  if arch is None:
    known = ", ".join(models.get(a).HF_MODEL_TYPE for a in models.ARCHS)
    raise _refuse(directory, f"model_type {model_type!r} is not supported: acco_jax runs {known}")
  return arch


def model_fields(directory: str) -> dict[str, Any]:
  """The :class:`ModelConfig` fields ``config.json`` sets: ``arch`` and the sizes."""
  hf = read_config(directory)
  arch = architecture(hf, directory)
  try:
    fields = models.from_hf_config(arch, hf)  # the fields the schema lets it set
  except KeyError as e:
    raise _refuse(directory, f"config.json lacks {e.args[0]!r}, which {arch} needs") from None
  except errors.UserValueError as e:
    raise _refuse(directory, str(e)) from None
  return {"arch": arch, **{k: v for k, v in fields.items() if v is not None}}


def model_config(directory: str, **overrides) -> ModelConfig:
  """The model of ``config.json``, with run settings (dtype, remat, attention, vocab_multiple) from
  ``overrides``."""
  return ModelConfig(**{**model_fields(directory), **overrides})


def special_ids(directory: str) -> dict[str, int | None]:
  """``config.json``'s ``bos_token_id`` and ``eos_token_id`` (None where absent)."""
  hf = read_config(directory)
  pick = lambda v: v[0] if isinstance(v, list) and v else v
  return {"bos": pick(hf.get("bos_token_id")), "eos": pick(hf.get("eos_token_id"))}


# -- reading safetensors --------------------------------------------------------------------------


class Entry(NamedTuple):
  """Where one tensor lies in a safetensors file."""

  path: str
  dtype: np.dtype | None  # None: a dtype acco_jax does not read (``stored`` names it)
  shape: tuple[int, ...]
  offset: int  # bytes from the start of the file
  stored: str = ""  # the header's dtype name (F32, BF16, BOOL, ...)


def _truncated(path: str, what: str, end: int, size: int) -> errors.UserValueError:
  return _refuse(
    os.path.dirname(path),
    f"{os.path.basename(path)} is truncated or damaged: {what} ends at byte {end:,}, the file "
    f"holds {size:,} bytes (an interrupted download?): download it again",
  )


def _header(path: str) -> dict[str, Entry]:
  """The tensors of one safetensors file, each checked to lie inside the file (nothing read)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise _truncated(path, "the header's length", 8, size)
    (length,) = struct.unpack("<Q", head)
    if 8 + length > size:
      raise _truncated(path, "the header", 8 + length, size)
    try:
      header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise _refuse(
        os.path.dirname(path), f"{os.path.basename(path)} is not safetensors ({e})"
      ) from None
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    begin, end = info["data_offsets"]
    if 8 + length + end > size:
      raise _truncated(path, f"tensor {name}", 8 + length + end, size)
    dtype = _DTYPES.get(info["dtype"])
    if dtype is not None and end - begin != math.prod(info["shape"]) * dtype.itemsize:
      raise _refuse(
        os.path.dirname(path),
        f"{os.path.basename(path)} is damaged: tensor {name} of shape {info['shape']} "
        f"({info['dtype']}) spans {end - begin} bytes: download it again",
      )
    out[name] = Entry(path, dtype, tuple(info["shape"]), 8 + length + begin, info["dtype"])
  return out


def tensor_index(directory: str) -> dict[str, Entry]:
  """Every tensor of the directory's safetensors weights (one file, or the shards of an index)."""
  index = os.path.join(directory, INDEX)
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.isfile(os.path.join(directory, WEIGHTS)):
    files = [WEIGHTS]
  else:
    found = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth", ".h5"))]
    hint = f" (it has {', '.join(sorted(found))}: convert to safetensors)" if found else ""
    raise _refuse(
      directory, f"has no {WEIGHTS} or {INDEX}{hint}: save the model with save_pretrained"
    )
  out = {}
  for name in files:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      raise _refuse(directory, f"{INDEX} names {name}, which is missing")
    out.update(_header(path))
  return out


def _read(entry: Entry) -> np.ndarray:
  """The tensor, memory-mapped (no copy until converted)."""
  count = math.prod(entry.shape)
  return np.memmap(entry.path, entry.dtype, "r", entry.offset, (count,)).reshape(entry.shape)


def _expected_shape(t: HFTensor, leaf_shape: tuple[int, ...], cfg: ModelConfig) -> tuple:
  shape = list(leaf_shape)
  if t.vocab_rows:
    shape[0] = cfg.V
  return tuple(reversed(shape)) if t.transpose else tuple(shape)


def _leaf_shapes(cfg: ModelConfig) -> dict[tuple, tuple[int, ...]]:
  import jax  # only the shapes of the model's tree: no arrays

  from acco_jax import model

  leaves = jax.tree_util.tree_leaves_with_path(model.param_shapes(cfg))
  return {tuple(k.key for k in path): tuple(x.shape) for path, x in leaves}


def _local(name: str, index: dict, prefix: str) -> str | None:
  """The name a checkpoint stores ``name`` under: with or without the base model's prefix."""
  for n in (name, name.removeprefix(prefix)):
    if n in index:
      return n
  return None


def _check_dtype(directory: str, name: str, entry: Entry) -> None:
  if entry.dtype is None:
    raise _refuse(
      directory,
      f"tensor {name} is {entry.stored}: acco_jax reads float32, float16 and bfloat16 weights",
    )


def _check_tied_head(directory: str, head: str, embedding: str, index: dict) -> None:
  """A tied model's file that stores the head anyway: it must be the embedding (compared in
  blocks of rows, memory-mapped), else the checkpoint is not the tied model config.json says."""
  h, e = index[head], index[embedding]
  _check_dtype(directory, head, h)
  if h.shape != e.shape:
    raise _refuse(
      directory,
      f"tensor {head} has shape {list(h.shape)}, but the head is tied to {embedding} "
      f"{list(e.shape)} (config.json: tie_word_embeddings): fix tie_word_embeddings",
    )
  rows, step = _read(h), max(1, 2**24 // max(1, math.prod(h.shape[1:])))
  emb = _read(e)
  for i in range(0, h.shape[0], step):
    a, b = rows[i : i + step].astype(np.float32), emb[i : i + step].astype(np.float32)
    if not np.array_equal(a, b):
      raise _refuse(
        directory,
        f"tensor {head} differs from {embedding}, but config.json ties the head to the "
        "embedding (tie_word_embeddings): set tie_word_embeddings to false if the head is its "
        "own, or remove the stale tensor",
      )


def check_weights(directory: str, cfg: ModelConfig) -> list[tuple[HFTensor, Entry]]:
  """Each parameter's tensor in the directory's files, checked against ``cfg`` from the headers:
  one-line refusals of a file cut short, a tensor missing, left over, of another shape or dtype.

  Tensors the architecture ignores (``HF_IGNORED``: buffers old versions saved, of any dtype) are
  set aside first. A tied model's head stored anyway (``HF_TIED_HEAD``) is read once and must
  equal the embedding."""
  arch = models.get(cfg.arch)
  index, leaves = tensor_index(directory), _leaf_shapes(cfg)
  ignored = [re.compile(rf"(?:{re.escape(arch.HF_PREFIX)})?{p}$") for p in arch.HF_IGNORED]
  index = {n: e for n, e in index.items() if not any(p.match(n) for p in ignored)}
  planned, used = [], set()
  for t in arch.hf_tensors(cfg):
    name = _local(t.name, index, arch.HF_PREFIX)
    if name is None:
      raise _refuse(
        directory,
        f"tensor {t.name} is missing from its weights: they are not the model config.json "
        "describes",
      )
    entry, want = index[name], _expected_shape(t, leaves[t.path], cfg)
    if entry.shape != want:
      raise _refuse(
        directory, f"tensor {name} has shape {list(entry.shape)}, config.json implies {list(want)}"
      )
    _check_dtype(directory, name, entry)
    planned.append((t, entry))
    used.add(name)
  tied = getattr(arch, "HF_TIED_HEAD", None)  # (the head's name, the embedding's)
  head = tied and cfg.tied_head and _local(tied[0], index, arch.HF_PREFIX)
  extra = sorted(n for n in index if n not in used and n != head)
  if extra:
    more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
    raise _refuse(
      directory,
      f"tensors {', '.join(extra[:3])}{more} are not part of a {cfg.arch} model with this "
      "config.json: another architecture's weights, or a config that does not match them",
    )
  if head:
    _check_tied_head(directory, head, _local(tied[1], index, arch.HF_PREFIX), index)
  return planned


def _to_leaf(t: HFTensor, entry: Entry, cfg: ModelConfig) -> np.ndarray:
  """One tensor as this project's float32 leaf, in one new array (transposed, rows padded)."""
  src = _read(entry)
  if t.transpose:
    src = src.T
  rows = cfg.padded_vocab if t.vocab_rows else src.shape[0]
  out = np.empty((rows, *src.shape[1:]), np.float32)
  out[: src.shape[0]] = src
  out[src.shape[0] :] = 0.0
  del src  # unmaps the file's pages
  return out


def load_params(
  directory: str, cfg: ModelConfig, place: Callable[[tuple, np.ndarray], Any] | None = None
) -> dict:
  """The model's parameters from the directory's weights (checked first: :func:`check_weights`).

  Args:
    directory: a local Hugging Face directory.
    cfg: the model (:func:`model_config`; the run's dtype and vocabulary padding).
    place: ``(path, float32 array) -> leaf``, called on each tensor as it is read (e.g. put it on
      the run's devices, so the host never holds more than one tensor beyond what is placed);
      default: the numpy array.

  Returns:
    The parameter tree of ``model.init_params(cfg, ...)``'s structure.
  """
  place = place or (lambda path, x: x)
  params: dict = {}
  for t, entry in check_weights(directory, cfg):
    node = params
    for k in t.path[:-1]:
      node = node.setdefault(k, {})
    node[t.path[-1]] = place(t.path, _to_leaf(t, entry, cfg))
  return params


# -- writing --------------------------------------------------------------------------------------


def as_source_wrote(ours, theirs):
  """``ours`` with each number the source's config gives the same float32 value written as the
  source wrote it (``9.999999747378752e-06`` stays that, ``1e-05`` stays ``1e-05``)."""
  if isinstance(ours, dict) and isinstance(theirs, dict):
    return {k: as_source_wrote(v, theirs.get(k)) for k, v in ours.items()}
  numbers = (int, float)
  if (
    isinstance(ours, float)
    and isinstance(theirs, numbers)
    and not isinstance(theirs, bool)
    and np.float32(ours) == np.float32(theirs)
  ):
    return theirs
  return ours


def hf_config(
  cfg: ModelConfig, *, dtype: str = "float32", bos_id=None, eos_id=None, source: dict | None = None
) -> dict:
  """The ``config.json`` of ``cfg``; with ``source`` (the ``config.json`` the run started from),
  its floats as the source wrote them and its ``pad_token_id``."""
  arch = models.get(cfg.arch)
  out = {
    "architectures": [arch.HF_ARCHITECTURE],
    "model_type": arch.HF_MODEL_TYPE,
    **arch.to_hf_config(cfg),
    "dtype": dtype,
    "torch_dtype": dtype,
  }
  if eos_id is not None:
    out["eos_token_id"] = int(eos_id)
    out["bos_token_id"] = int(eos_id if bos_id is None else bos_id)
  if source:
    out = as_source_wrote(out, source)
    if source.get("pad_token_id") is not None:
      out["pad_token_id"] = source["pad_token_id"]
  return out


def _ids(value) -> list[int]:
  return [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]


def generation_config(eos_ids, bos_id=None, source_dir: str | None = None) -> dict:
  """``generation_config.json``: ``eos_ids`` (the end-of-text and a chat template's end-of-turn)
  and the source's own stop ids as ``eos_token_id``; the source's other settings (bos, pad,
  sampling) as it wrote them (its ``generation_config.json``, else its ``config.json``)."""
  gen, cfg = {}, {}
  if source_dir is not None:
    for name, into in ((GENERATION, gen), (CONFIG, cfg)):
      if os.path.isfile(os.path.join(source_dir, name)):
        with open(os.path.join(source_dir, name)) as f:
          into.update(json.load(f))
  for key in ("transformers_version", "_from_model_config"):
    gen.pop(key, None)
  eos = list(dict.fromkeys(_ids(list(eos_ids)) + _ids(gen.get("eos_token_id"))))
  out = {**gen, "eos_token_id": eos[0] if len(eos) == 1 else eos}
  for key, default in (("bos_token_id", bos_id), ("pad_token_id", None)):
    value = gen.get(key, cfg.get(key, default))
    if value is not None:
      out[key] = value
  return out


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _from_leaf(t: HFTensor, leaf, cfg: ModelConfig, dtype) -> np.ndarray:
  x = np.asarray(leaf, np.float32)
  if t.vocab_rows:
    x = x[: cfg.V]
  return np.ascontiguousarray(x.T if t.transpose else x).astype(dtype)


def _shards(tensors: list[HFTensor], cfg: ModelConfig, itemsize: int, shard_bytes: int):
  shapes, groups, size = _leaf_shapes(cfg), [[]], 0
  for t in tensors:
    n = math.prod(_expected_shape(t, shapes[t.path], cfg)) * itemsize
    if groups[-1] and size + n > shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(t)
    size += n
  return groups


def save(
  out_dir: str,
  params,
  cfg: ModelConfig,
  *,
  dtype: str = "float32",
  tokenizer=None,
  bos_id: int | None = None,
  eos_id: int | None = None,
  stop_ids: tuple[int, ...] = (),
  source_dir: str | None = None,
  shard_bytes: int = 5 * 2**30,
) -> str:
  """Writes ``params`` as a Hugging Face directory at ``out_dir`` (which must not exist, or be
  empty); everything goes to a temporary directory beside it first, renamed at the end.

  Args:
    out_dir: the directory to create.
    params: the model's parameters (host or device arrays, any float dtype).
    cfg: their model.
    dtype: the weights' dtype on disk, ``float32`` or ``bfloat16``.
    tokenizer: an :class:`acco_jax.data.Tokenizer` to write beside the weights (its ``to_hf``).
    bos_id, eos_id: ``config.json``'s special ids.
    stop_ids: ``generation_config.json``'s ``eos_token_id`` (``eos_id`` when empty; the file is
      written where either is given).
    source_dir: the Hugging Face directory the run started from, if any: ``config.json``'s floats
      as it wrote them, its pad id and generation settings (:func:`generation_config`).
    shard_bytes: weights beyond this go to several files with ``model.safetensors.index.json``.
  """
  from safetensors.numpy import save_file

  if dtype not in _SAVE_DTYPES:
    raise errors.UserValueError(f"dtype={dtype!r}: write float32 or bfloat16")
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise errors.UserValueError(
      f"{out_dir} exists and is not empty: give a new directory (nothing was written)"
    )
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
  try:
    np_dtype = _SAVE_DTYPES[dtype]
    tensors = models.get(cfg.arch).hf_tensors(cfg)
    groups = _shards(tensors, cfg, np.dtype(np_dtype).itemsize, shard_bytes)
    weight_map = {}
    for i, group in enumerate(groups):
      name = WEIGHTS if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
      arrays = {t.name: _from_leaf(t, _get(params, t.path), cfg, np_dtype) for t in group}
      save_file(arrays, os.path.join(tmp, name), metadata={"format": "pt"})
      weight_map.update(dict.fromkeys(arrays, name))
      del arrays
    if len(groups) > 1:
      with open(os.path.join(tmp, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    source = None
    if source_dir is not None and os.path.isfile(os.path.join(source_dir, CONFIG)):
      source = read_config(source_dir)
    config = hf_config(cfg, dtype=dtype, bos_id=bos_id, eos_id=eos_id, source=source)
    with open(os.path.join(tmp, CONFIG), "w") as f:
      json.dump(config, f, indent=2)
    stops = tuple(stop_ids) or (() if eos_id is None else (eos_id,))
    if stops:
      with open(os.path.join(tmp, GENERATION), "w") as f:
        json.dump(generation_config(stops, config.get("bos_token_id"), source_dir), f, indent=2)
    if tokenizer is not None:
      tokenizer.to_hf(tmp)
    os.chmod(tmp, 0o755)
    if os.path.isdir(out_dir):
      os.rmdir(out_dir)  # empty (checked above)
    os.rename(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir
