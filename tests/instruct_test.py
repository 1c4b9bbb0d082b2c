"""Instruction data: the loss mask token by token, packed rows against each example alone, buckets,
and the refusals of bad files. References are written out by hand here (byte ids: a character is
its code), never computed by the code under test."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax import errors, model
from acco_jax.data import chat, examples, instruct
from acco_jax.data.instruct import Example
from acco_jax.data.tokenizer import ByteTokenizer, get_tokenizer

# jitted once per shape (eagerly, each op of the model compiles on its own: 25 s a test)
_apply = jax.jit(model.apply, static_argnums=1)
_init = jax.jit(model.init_params, static_argnums=(0, 1))
_loss = jax.jit(model.loss_fn, static_argnums=1)

BYTES = ByteTokenizer()
EOT = BYTES.eot_id  # 256


def _jsonl(tmp_path, records, name="data.jsonl"):
  path = tmp_path / name
  path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
  return str(path)


def test_prompt_completion_weights_token_by_token(tmp_path):
  path = _jsonl(tmp_path, [{"prompt": "Q:ab\n", "completion": "cd"}])
  (ex,) = instruct.read_jsonl(path, "prompt_completion")
  enc = examples.encode(BYTES, [ex])
  ids, trained = enc.example(0)
  #           Q   :   a   b  \n   c    d   eot
  want_ids = [81, 58, 97, 98, 10, 99, 100, EOT]
  assert ids.tolist() == want_ids
  assert trained.tolist() == [False] * 5 + [True] * 3  # the response and its end-of-text
  row = examples._row(enc, [0], 10, packed=False)
  assert row["inputs"].tolist() == [81, 58, 97, 98, 10, 99, 100, 0, 0, 0]
  assert row["targets"].tolist() == [58, 97, 98, 10, 99, 100, EOT, 0, 0, 0]
  # a target weighs 1 iff it is the response's ('c' after '\n', 'd', then end-of-text)
  assert row["weights"].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]


def test_alpaca_prompt_and_answer(tmp_path):
  path = _jsonl(
    tmp_path,
    [
      {"instruction": "Add.", "input": "1+1", "output": "2"},
      {"instruction": "Hi", "output": "Hello"},
    ],
  )
  with_input, plain = instruct.read_jsonl(path, "alpaca")
  assert with_input.prompt.endswith("### Instruction:\nAdd.\n\n### Input:\n1+1\n\n### Response:\n")
  assert "### Input" not in plain.prompt and plain.prompt.endswith("### Response:\n")
  assert (with_input.answer, plain.answer) == ("2", "Hello")


def test_builtin_chat_trains_every_assistant_turn():
  ex = Example(
    instruct.chat_pieces(
      [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
      ]
    )
  )
  enc = examples.encode(BYTES, [ex])
  ids, trained = enc.example(0)
  text = bytes(int(i) for i in ids if i < 256).decode()
  assert text == "<|user|>\na\n<|assistant|>\nb<|user|>\nc\n<|assistant|>\nd"
  kept = "".join(
    chr(i) for i, t in zip(ids.tolist(), trained.tolist(), strict=True) if t and i < 256
  )
  assert kept == "bd" and trained[-1]  # both replies and the final end-of-text
  assert bytes(examples.prompt_ids(enc, 0).tolist()).decode().endswith("c\n<|assistant|>\n")


MARKED = (
  "{% for m in messages %}{% if m['role'] == 'assistant' %}A: {% generation %}{{ m['content'] }}"
  "{% endgeneration %}\n{% else %}U: {{ m['content'] }}\n{% endif %}{% endfor %}"
)


def _template(source, specials=("<|im_end|>", "<|eot_id|>")):
  return chat.Template(source, "t.jinja", {"bos_token": "<|begin_of_text|>"}, specials)


def test_hf_chat_template_with_generation_marks():
  messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
  pieces = chat.pieces(_template(MARKED), messages, "x")
  # rendered as transformers renders it (trim_blocks: the newline after a block tag goes)
  assert pieces == (("U: hi\nA: ", False), ("yo", True))


def test_generation_marks_are_read_from_the_tags_not_the_words():
  assert chat.has_generation_marks(_template(MARKED))
  assert not chat.has_generation_marks(_template(CHATML))  # it says add_generation_prompt


# A ChatML template as SmolLM2 and Qwen ship it (no generation marks): a default system turn, each
# message closed by <|im_end|> and a newline, the assistant's header as the generation prompt.
CHATML = (
  "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
  "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}"
  "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 3's layout: a BOS, headers between special tokens, each turn closed by <|eot_id|>.
LLAMA3 = (
  "{{ bos_token }}{% for message in messages %}"
  "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
  " + '<|eot_id|>' }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
TWO_TURNS = [
  {"role": "user", "content": "a"},
  {"role": "assistant", "content": "b c"},
  {"role": "user", "content": "d"},
  {"role": "assistant", "content": "e"},
]


def test_chatml_without_marks_trains_each_assistant_turn_and_its_end():
  pieces = chat.pieces(_template(CHATML), TWO_TURNS, "x")
  sys = "<|im_start|>system\nBe brief.<|im_end|>\n"
  assert pieces == (
    (sys + "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n", False),
    ("b c<|im_end|>", True),
    ("\n<|im_start|>user\nd<|im_end|>\n<|im_start|>assistant\n", False),
    ("e<|im_end|>", True),
    ("\n", False),
  )
  assert chat.end_of_turn(_template(CHATML), "e<|im_end|>") == "<|im_end|>"


def test_llama3_layout_without_marks():
  pieces = chat.pieces(_template(LLAMA3), TWO_TURNS[:2], "x")
  head = "<|start_header_id|>{}<|end_header_id|>\n\n"
  assert pieces == (
    ("<|begin_of_text|>" + head.format("user") + "a<|eot_id|>" + head.format("assistant"), False),
    ("b c<|eot_id|>", True),
  )


def test_template_whose_prefixes_are_not_prefixes_is_refused(tmp_path):
  # the number of messages printed first: rendering one more message changes the start
  template = _template(
    "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
  )
  path = _jsonl(tmp_path, [{"messages": TWO_TURNS[:2]}])
  with pytest.raises(errors.UserValueError, match=r"t.jinja renders message 1 so that") as info:
    instruct.read_jsonl(path, "chat", template)
  assert "\n" not in str(info.value)


# -- a chat template's tokens: the mask of the whole text's ids, written out by hand ----------------

CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
LLAMA3_SPECIALS += ["<|end_header_id|>", "<|eot_id|>"]


def _model_dir(tmp_path, words, specials, settings, jinja=None):
  """A tokenizer directory: a Unigram model whose ``words`` beat single characters (so the ids
  below are known by hand), ``specials`` added, ``tokenizer_config.json`` and a template file."""
  import tokenizers

  chars = sorted(set(map(chr, range(32, 127))) | {"\n"})
  vocab = [("<unk>", 0.0)] + [(w, -1.0) for w in words] + [(c, -10.0) for c in chars]
  tok = tokenizers.Tokenizer(tokenizers.models.Unigram(vocab, unk_id=0))
  tok.add_special_tokens(specials)
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
  if jinja is not None:
    (tmp_path / "chat_template.jinja").write_text(jinja)
  return tok


def _rendered_tokens(tmp_path, tok, records):
  hf_tok = get_tokenizer(f"hf:{tmp_path}")
  template = examples.template_of(hf_tok, "hf")
  exs = instruct.read_jsonl(_jsonl(tmp_path, records), "chat", template)
  enc = examples.encode(hf_tok, exs)
  ids, trained = enc.example(0)
  return [tok.id_to_token(int(i)) for i in ids], trained.tolist(), enc, hf_tok, exs


def test_chatml_template_file_trains_the_tokens_of_each_turn_and_its_end(tmp_path):
  words = ["system", "user", "assistant", "Be", " brief.", " c", "\nb"]
  settings = {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}
  tok = _model_dir(tmp_path, words, CHATML_SPECIALS, settings, jinja=CHATML)
  got, trained, enc, hf_tok, exs = _rendered_tokens(tmp_path, tok, [{"messages": TWO_TURNS}])
  S, E = "<|im_start|>", "<|im_end|>"
  want = [
    (S, 0), ("system", 0), ("\n", 0), ("Be", 0), (" brief.", 0), (E, 0), ("\n", 0),
    (S, 0), ("user", 0), ("\n", 0), ("a", 0), (E, 0), ("\n", 0),
    (S, 0), ("assistant", 0), ("\nb", 1), (" c", 1), (E, 1), ("\n", 0),  # '\nb' straddles: trained
    (S, 0), ("user", 0), ("\n", 0), ("d", 0), (E, 0), ("\n", 0),
    (S, 0), ("assistant", 0), ("\n", 0), ("e", 1), (E, 1), ("\n", 0),
  ]  # fmt: skip
  assert got == [t for t, _ in want]
  assert trained == [bool(f) for _, f in want]
  # the reply to the last turn is asked after its generation prompt, and stops at <|im_end|>
  prompt = [tok.id_to_token(int(i)) for i in examples.prompt_ids(enc, 0)]
  assert prompt == got[: len(want) - 3] and prompt[-3:] == [S, "assistant", "\n"]
  assert tok.token_to_id(E) in examples.stop_ids(hf_tok, exs)
  assert exs[0].answer == "e"


def test_llama3_template_of_a_named_list_without_marks(tmp_path):
  words = ["user", "assistant", "\n\n", " c"]
  settings = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "chat_template": [{"name": "tool_use", "template": "{{ 1 }}"}, {"name": "default", "template": LLAMA3}],
  }  # fmt: skip
  tok = _model_dir(tmp_path, words, LLAMA3_SPECIALS, settings)
  got, trained, _, hf_tok, exs = _rendered_tokens(tmp_path, tok, [{"messages": TWO_TURNS[:2]}])
  B, H, EH, T = "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
  want = [
    (B, 0), (H, 0), ("user", 0), (EH, 0), ("\n\n", 0), ("a", 0), (T, 0),
    (H, 0), ("assistant", 0), (EH, 0), ("\n\n", 0), ("b", 1), (" c", 1), (T, 1),
  ]  # fmt: skip
  assert got == [t for t, _ in want]
  assert trained == [bool(f) for _, f in want]
  stops = examples.stop_ids(hf_tok, exs)
  assert set(stops) == {tok.token_to_id("<|end_of_text|>"), tok.token_to_id(T)}


def test_a_directory_without_a_chat_template_is_refused_in_one_line(tmp_path):
  _model_dir(tmp_path, [], CHATML_SPECIALS, {"eos_token": "<|im_end|>"})
  with pytest.raises(errors.UserValueError, match="has no chat template") as info:
    examples.template_of(get_tokenizer(f"hf:{tmp_path}"), "hf")
  assert "\n" not in str(info.value)


BAD_FILES = {
  "not-json": (
    ['{"prompt": "a", "completion": "b"}', '{"prompt": "a",'],
    r"data.jsonl:2: not a JSON object",
  ),
  "missing-field": (
    [{"prompt": "a"}],
    r"data.jsonl:1: field 'completion' is missing, not a string",
  ),
  "not-a-string": ([{"prompt": "a", "completion": 3}], r"field 'completion' is a int"),
  "empty-response": ([{"prompt": "a", "completion": "  "}], r"data.jsonl:1: the response is empty"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_file_is_one_line_naming_file_and_line(case, tmp_path):
  records, match = BAD_FILES[case]
  with pytest.raises(errors.UserValueError, match=match) as info:
    instruct.read_jsonl(_jsonl(tmp_path, records), "prompt_completion")
  assert "\n" not in str(info.value)


def test_embedded_set_is_fixed_and_checkable():
  a, b = instruct.embedded_examples(60), instruct.embedded_examples(60)
  assert a == b and len(a) == 60
  by_task = {}
  for ex in a:
    by_task.setdefault(ex.prompt.splitlines()[0], []).append(ex)
  assert sorted(len(v) for v in by_task.values()) == [20, 20, 20]
  books = {ex.answer.strip() for ex in by_task["Which book of the Bible is this verse from?"]}
  assert books <= set(instruct._books()) and len(books) > 3
  for ex in by_task["What is the first word of this verse?"]:
    assert ex.prompt.splitlines()[1].startswith(f"Verse:{ex.answer}")
  for ex in by_task["What is the last word of this verse?"]:
    verse = ex.prompt.splitlines()[1]
    assert verse.rstrip(".;:,?!'\" ").endswith(ex.answer.strip())
  assert all(ex.prompt.endswith("\nAnswer:") and ex.answer.startswith(" ") for ex in a)


# -- rows ------------------------------------------------------------------------------------------


def _encoded(lengths, trained_from=2):
  """Examples of the given id counts (end-of-text included), ids 1, 2, ..., trained from the
  ``trained_from``-th id on."""
  exs = []
  for n in lengths:
    prompt = "".join(chr(ord("a") + i % 26) for i in range(trained_from))
    response = "".join(chr(ord("A") + i % 26) for i in range(n - 1 - trained_from))
    exs.append(Example(((prompt, False), (response, True))))
  return examples.encode(BYTES, exs)


def test_packing_first_fit_in_order_and_truncation():
  enc = _encoded([5, 4, 6, 20, 3])  # positions: 4, 3, 5, 19, 2
  assert examples.pack(enc, 8) == [[0, 1], [2], [3], [4]]  # 4 + 3 fit; 5 + 2 would not go first
  assert examples.truncation(enc, 8) == (1, 0)  # the 20-id example cut to 9 ids, kept
  prompt_only = examples.encode(BYTES, [Example((("x" * 20, False), ("y", True)))])
  assert examples.truncation(prompt_only, 8) == (1, 1)  # its response lies past the cut: dropped
  row = examples._row(enc, [0, 1], 8, packed=True)
  assert row["segments"].tolist() == [1, 1, 1, 1, 2, 2, 2, 0]
  assert row["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
  assert row["weights"].tolist() == [0, 1, 1, 1, 0, 1, 1, 0]


def test_buckets_are_multiples_padded_to_the_batch_longest():
  enc = _encoded([5, 12, 40, 7, 70, 9, 30, 3])
  it = examples.batches(enc, seq_len=64, global_batch_rows=2, seed=0, bucket=16, shuffle=False)
  widths = [b["inputs"].shape[1] for b in (next(it) for _ in range(4))]
  # pairs (5, 12) (40, 7) (70 -> cut to 64, 9) (30, 3): longest 11, 39, 64, 29 positions
  assert widths == [16, 48, 64, 32]


def test_every_process_takes_its_rows_of_one_bucketed_global_batch():
  enc = _encoded([5, 12, 40, 7, 70, 9, 30, 3])
  whole = examples.batches(enc, seq_len=64, global_batch_rows=4, seed=1, bucket=16)
  parts = [
    examples.batches(
      enc, seq_len=64, global_batch_rows=4, seed=1, bucket=16, process_index=p, process_count=2
    )
    for p in range(2)
  ]
  for _ in range(3):
    w = next(whole)
    a, b = next(parts[0]), next(parts[1])
    np.testing.assert_array_equal(np.concatenate([a["inputs"], b["inputs"]]), w["inputs"])


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neo", "llama"])
def test_a_packed_row_gives_each_example_its_own_logits(arch):
  """Positions restart and attention stays inside each example: the packed row's logits at each
  example's positions are the ones it gets alone (GPT-Neo's local window shorter than them)."""
  local = {"window": 4} if arch == "gpt_neo" else {}
  cfg = model.get_config("tiny", arch=arch, dtype="float32", V=257, **local)
  params = _init(cfg, 0)
  enc = _encoded([9, 6, 12])
  row = examples._row(enc, [0, 1, 2], 32, packed=True)
  packed = _apply(
    params,
    cfg,
    row["inputs"][None],
    positions_BxL=row["positions"][None],
    segments_BxL=row["segments"][None],
  )[0]
  at = 0
  for i in range(3):
    ids, _ = enc.example(i)
    alone = _apply(params, cfg, jnp.asarray(ids[:-1])[None])[0]
    np.testing.assert_allclose(packed[at : at + len(ids) - 1], alone, rtol=2e-5, atol=2e-5)
    at += len(ids) - 1
  # the same row without the segments (attention across examples) or the positions differs
  crossed = _apply(params, cfg, row["inputs"][None], positions_BxL=row["positions"][None])[0]
  assert np.max(np.abs(crossed[8:13] - packed[8:13])) > 1e-3
  if arch != "llama":  # RoPE's scores depend on positions' differences only: restarting is moot
    unrestarted = _apply(params, cfg, row["inputs"][None], segments_BxL=row["segments"][None])
    assert np.max(np.abs(unrestarted[0, 8:13] - packed[8:13])) > 1e-3


def test_packed_loss_is_the_response_tokens_mean():
  cfg = model.get_config("tiny", dtype="float32", V=257)
  params = _init(cfg, 1)
  enc = _encoded([9, 6])
  row = {k: jnp.asarray(v[None]) for k, v in examples._row(enc, [0, 1], 16, packed=True).items()}
  loss, aux = _loss(params, cfg, row)
  want_sum, count = 0.0, 0
  for i in range(2):
    ids, trained = enc.example(i)
    logp = jax.nn.log_softmax(_apply(params, cfg, jnp.asarray(ids[:-1])[None])[0])
    for t in range(len(ids) - 1):
      if trained[t + 1]:
        want_sum, count = want_sum - float(logp[t, ids[t + 1]]), count + 1
  assert float(aux["tokens"]) == count == 7 + 4  # each response and its end-of-text
  np.testing.assert_allclose(float(loss), want_sum / count, rtol=1e-5)
