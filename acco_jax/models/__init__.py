"""The architectures a run can train: GPT-2, GPT-Neo, Llama, Qwen2, Qwen3 and Mistral, one module each.

Each module implements :class:`acco_jax.models.base.Architecture`; :mod:`acco_jax.model` is the
interface the rest of the package calls (it composes an architecture's pieces into the model).
``model.arch`` in a config, or :attr:`~acco_jax.models.base.ModelConfig.arch`, picks one.
"""

from __future__ import annotations

from types import ModuleType

from acco_jax import errors
from acco_jax.models import base, gpt2, gpt_neo, llama, mistral, qwen2, qwen3
from acco_jax.models.base import ARCHS as ARCHS
from acco_jax.models.base import ModelConfig as ModelConfig

_BY_NAME: dict[str, ModuleType] = {  # one line an architecture, in base.ARCHS' order
  "gpt2": gpt2,
  "gpt_neo": gpt_neo,
  "llama": llama,
  "qwen2": qwen2,
  "qwen3": qwen3,
  "mistral": mistral,
}
assert tuple(_BY_NAME) == ARCHS
for _name, _module in _BY_NAME.items():
  base.register(_name, _module.check, _module.USES)


def get(arch: str) -> base.Architecture:
  """The module of architecture ``arch`` (one-line error naming the others)."""
  if arch not in _BY_NAME:
    raise errors.UserValueError(f"model.arch={arch!r} is unknown: choose one of {', '.join(ARCHS)}")
  return _BY_NAME[arch]


def by_hf_model_type(model_type: str) -> str | None:
  """The architecture whose Hugging Face ``model_type`` is ``model_type``, or None."""
  return next((a for a, m in _BY_NAME.items() if m.HF_MODEL_TYPE == model_type), None)


def from_hf_config(arch: str, hf: dict) -> dict:
  """The :class:`ModelConfig` fields of a ``config.json`` of ``arch``: the architecture's reading
  of it, which may set only sizes and forms it uses (never a run's setting: :data:`base.FIELDS`),
  its None values left to the defaults."""
  fields = {k: v for k, v in get(arch).from_hf_config(hf).items() if v is not None}
  wrong = [k for k in fields if base.FIELDS[k].kind == base.SETTING or not base.uses(arch, k)]
  assert not wrong, f"{arch}.from_hf_config sets {wrong}, which its config.json cannot set"
  return fields
