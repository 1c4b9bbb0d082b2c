"""Hugging Face chat templates: read from a tokenizer's directory, rendered, and cut into the text a
fine-tune trains on (the assistant's turns) and the text it does not.

A template (:class:`Template`) is the Jinja source a model directory ships, in ``chat_template.jinja``
(transformers 5) or in ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
templates of which ``default`` is taken), with the special tokens it may print (``bos_token``,
``eos_token``, ...). :func:`pieces` renders a conversation and says which text is trained on:

- a template that marks the assistant's text with ``{% generation %} ... {% endgeneration %}`` (what
  transformers' ``return_assistant_tokens_mask`` reads): the text inside the marks;
- any other template (Llama 3, Qwen, Mistral and SmolLM2 ship none): each assistant turn is what
  rendering the conversation up to that turn adds to rendering the conversation before it with
  ``add_generation_prompt=True``, less the white space that follows the turn's end-of-turn token.
  That needs every such rendering to be a prefix of the next; a template for which one is not is
  refused in one line naming it.

The end-of-turn text (``<|im_end|>``, ``<|eot_id|>``) closes each trained span, so the model learns to
stop, and is what a greedy reply stops on (:func:`end_of_turn`).

Rendering is transformers' setting (``trim_blocks``, ``lstrip_blocks``, loop controls,
``raise_exception``, ``tojson``) in a sandbox; ``strftime_now`` is left undefined, so templates that
print today's date (Llama 3.1) fall back to their fixed one and the rendered data does not change
from one day to the next (a resumed run reads the same tokens).
"""

from __future__ import annotations

import json
import os
import re
from typing import NamedTuple

from acco_jax import errors

TEMPLATE_FILE = "chat_template.jinja"
SETTINGS_FILE = "tokenizer_config.json"
_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")
_GEN_START, _GEN_END = "\x00<generation>\x00", "\x00</generation>\x00"


class Template(NamedTuple):
  """A chat template and what it renders with."""

  source: str  # the Jinja text
  where: str  # the file it came from (named in refusals)
  specials: dict[str, str]  # bos_token, eos_token, ... as tokenizer_config.json gives them
  special_tokens: tuple[str, ...]  # every special token's text (end-of-turn candidates)


def _special(value) -> str | None:
  return value.get("content") if isinstance(value, dict) else value


def read(directory: str, special_tokens: tuple[str, ...] = ()) -> Template | None:
  """The chat template of a tokenizer's directory, or None where it has none."""
  settings = {}
  path = os.path.join(directory, SETTINGS_FILE)
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      settings = json.load(f)
  specials = {k: _special(settings[k]) for k in _SPECIALS if _special(settings.get(k))}
  jinja = os.path.join(directory, TEMPLATE_FILE)
  if os.path.isfile(jinja):
    with open(jinja, encoding="utf-8") as f:
      return Template(f.read(), jinja, specials, special_tokens)
  source = settings.get("chat_template")
  if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}, ...]
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    source = named.get("default")
  if not isinstance(source, str) or not source.strip():
    return None
  return Template(source, path, specials, special_tokens)


def _environment(marks: bool):
  import jinja2
  from jinja2 import nodes
  from jinja2.ext import Extension, loopcontrols
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(Extension):
    """``{% generation %}``: the text inside is wrapped in markers (or left as it is)."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
      return f"{_GEN_START}{caller()}{_GEN_END}" if marks else caller()

  def refuse(message):
    raise jinja2.exceptions.TemplateError(message)

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
  )
  env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
    x, ensure_ascii=False, indent=indent
  )
  env.globals["raise_exception"] = refuse
  return env


def has_generation_marks(template: Template) -> bool:
  """Whether the template has a ``{% generation %}`` block (read from its tokens, so a variable
  named ``add_generation_prompt`` does not count)."""
  lexed = _environment(False).lex(template.source)
  tokens = [(kind, value) for _, kind, value in lexed if kind != "whitespace"]
  return any(
    kind == "block_begin" and nxt == ("name", "generation")
    for (kind, _), nxt in zip(tokens, tokens[1:], strict=False)
  )


def render(template: Template, messages: list[dict], generation_prompt: bool, marks=False) -> str:
  """The template's text of ``messages`` (one-line refusal of a template that fails)."""
  import jinja2

  try:
    compiled = _environment(marks).from_string(template.source)
    return compiled.render(
      messages=messages, add_generation_prompt=generation_prompt, **template.specials
    )
  except jinja2.exceptions.TemplateError as e:
    raise errors.UserValueError(
      f"chat template {template.where}: {e} (data.chat_template=builtin uses the built-in one)"
    ) from None


def _marked_pieces(template: Template, messages: list[dict]):
  text = render(template, messages, False, marks=True)
  pieces, trained = [], False
  for part in re.split(f"({re.escape(_GEN_START)}|{re.escape(_GEN_END)})", text):
    if part in (_GEN_START, _GEN_END):
      trained = part == _GEN_START
    elif part:
      pieces.append((part, trained))
  return tuple(pieces)


def _derived_pieces(template: Template, messages: list[dict], where: str):
  whole = render(template, messages, False)
  pieces, done = [], 0
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    before = render(template, messages[:i], True)
    through = render(template, messages[: i + 1], False)
    if before.startswith(whole[:done]) and through.startswith(before) and whole.startswith(through):
      turn = through[len(before) :].rstrip()
      if before[done:]:
        pieces.append((before[done:], False))
      pieces.append((turn, True))
      done = len(before) + len(turn)
      continue
    raise errors.UserValueError(
      f"{where}: chat template {template.where} renders message {i} so that the conversation "
      "before it is not a prefix of the conversation with it, so its assistant turns cannot be "
      "told apart: add {% generation %} marks to the template, or use data.chat_template=builtin"
    )
  if whole[done:]:
    pieces.append((whole[done:], False))
  return tuple(pieces)


def pieces(template: Template, messages: list[dict], where: str):
  """``messages`` rendered as ``(text, trained)`` pieces: the assistant's turns trained on (see the
  module docstring), everything else not."""
  if has_generation_marks(template):
    return _marked_pieces(template, messages)
  return _derived_pieces(template, messages, where)


def end_of_turn(template: Template, turn: str) -> str:
  """The special token a trained turn ends with (the longest that matches), or ''."""
  ends = [t for t in template.special_tokens if t and turn.endswith(t)]
  return max(ends, key=len, default="")
