"""Every refusal before the work (issue 68, item 7): the run's ``train_and_evaluate`` refuses in one
line and the workdir stays empty (it is never created).

First the refusals that used to come late: the held-out split against the global batch (was: after
training every stage), ``data.bucket``, chat templates, ``train.profile_stages`` past the run's
stages (was: after ``metrics.jsonl`` and ``tb/`` were written); a truncated weights file is
``tests/hf_loader_test.py``'s. Then one test walks every in-process refusal docs/reliability.md
lists (the cases of ``bad_input_test``, ``hf_test``, ``sft_test``, ``hf_loader_test`` and this
file) through ``train_and_evaluate`` and asserts the same, so that a refactor of the trainer cannot
move one after the first write. All of them refuse before anything is compiled.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from acco_jax import errors
from acco_jax.run import trainer
from configs import gpt2_acco, gpt2_zero1
from tests import bad_input_test, hf_loader_test, hf_test, sft_test

REPO = pathlib.Path(__file__).resolve().parent.parent
RELIABILITY = REPO / "docs" / "reliability.md"


def refused_before_any_write(config, match, tmp_path, error=errors.UserError) -> str:
  """Runs ``config`` to its refusal; asserts one line and a workdir never created."""
  workdir = tmp_path / "workdir"
  with pytest.raises(error, match=match) as info:
    trainer.train_and_evaluate(config, str(workdir))
  message = bad_input_test.one_line(info.value)
  assert not workdir.exists(), f"the workdir was written before the refusal: {message}"
  return message


def _chat_file(tmp_path) -> pathlib.Path:
  turn = lambda i: [
    {"role": "user", "content": f"Say {i}."},
    {"role": "assistant", "content": f"{i}"},
  ]
  path = tmp_path / "chat.jsonl"
  path.write_text("".join(json.dumps({"messages": turn(i)}) + "\n" for i in range(40)))
  return path


def late_cases(tmp_path) -> dict:
  """The refusals issue 68 found after the work: ``name -> (config, match)``."""
  sft = lambda **o: sft_test.tiny(tmp_path, **o)
  return {
    # 200 examples, 3 held out: fewer than one global batch of 8 rows
    "held-out-smaller-than-a-batch": (
      sft(**{"data.eval_fraction": 0.015}),
      r"the held-out split \(data.eval_fraction=0.015\): the instruction data gives 3 examples",
    ),
    "bucket-zero": (sft(**{"data.bucket": 0}), r"data.bucket=0 must be >= 1"),
    "chat-template-unknown": (
      sft(
        **{
          "data.source": f"jsonl:{_chat_file(tmp_path)}",
          "data.format": "chat",
          "data.chat_template": "jinja",
        }
      ),
      r"data.chat_template='jinja'",
    ),
    "chat-template-missing": (
      sft(
        **{
          "data.source": f"jsonl:{_chat_file(tmp_path)}",
          "data.format": "chat",
          "data.chat_template": "hf",
        }
      ),
      r"has no chat.template",
    ),
    "profile-stages-past-the-run": (
      bad_input_test.tiny(**{"train.profile_stages": "3:900"}),
      r"train.profile_stages='3:900' ends after the run's 4 stages: choose b <= 4",
    ),
  }


LATE = [
  "held-out-smaller-than-a-batch",
  "bucket-zero",
  "chat-template-unknown",
  "chat-template-missing",
  "profile-stages-past-the-run",
]


@pytest.mark.parametrize("case", LATE)
def test_late_refusal_now_comes_before_any_write(case, tmp_path):
  config, match = late_cases(tmp_path)[case]
  refused_before_any_write(config, match, tmp_path)


# -- the walk over docs/reliability.md ---------------------------------------------------------------


def _walk_cases(tmp_path) -> dict:
  """Every in-process refusal of the tests docs/reliability.md names, by the id it names them by:
  ``id -> (config, match, error)``. Each case writes its files under its own folder."""
  from configs import gpt2_pipeline

  out, n = {}, iter(range(10**6))

  def folder():
    path = tmp_path / f"in{next(n)}"
    path.mkdir()
    return path

  for name, overrides, error, match, *_ in bad_input_test.CONFIGS:
    module = gpt2_zero1 if overrides.get("method") == "zero1" else gpt2_acco
    out[f"config[{name}]"] = (bad_input_test.tiny(module, **overrides), match, error)
  for name, overrides, match in bad_input_test.PIPELINE_CONFIGS:
    out[f"pipeline[{name}]"] = (bad_input_test.tiny(gpt2_pipeline, **overrides), match, ValueError)
  data = bad_input_test.data_cases(folder())
  for name, (source, error, match) in data.items():
    config = bad_input_test.tiny(**{"data.source": source, "data.data_dir": str(folder())})
    out[f"data[{name}]"] = (config, match, error)
  for name, (tokenizer, error, match) in bad_input_test.TOKENIZERS.items():
    out[f"tokenizer[{name}]"] = (bad_input_test.tiny(**{"data.tokenizer": tokenizer}), match, error)
  for name, match in hf_test.BAD_DIRS.items():
    directory = hf_test._bad_dir(folder(), name)
    config = hf_test._hf_config("gpt2", **{"data.tokenizer": f"hf:{hf_test.FIXTURES / 'gpt2'}"})
    config.model.init = f"hf:{directory}"
    out[f"bad_dir[{name}]"] = (config, match, errors.UserError)
  for name, (overrides, match) in hf_test.BAD_CONFIGS.items():
    config = hf_test._hf_config("gpt2", **overrides)
    if not config.model.init:
      config.data.tokenizer = "byte"
    out[f"hf_config[{name}]"] = (config, match, errors.UserError)
  for name, (text, match) in sft_test.BAD.items():
    path = folder() / "rev2.jsonl"
    path.write_text(text)
    config = sft_test.tiny(path.parent, **{"data.source": f"jsonl:{path}"})
    out[f"sft[{name}]"] = (config, match, errors.UserError)
  for name, (config, match) in late_cases(folder()).items():
    out[f"late[{name}]"] = (config, match, errors.UserError)
  d = hf_test._copy(folder(), "gpt2")
  hf_loader_test._truncate(d, lambda size: size - 100)
  config = hf_test._hf_config("gpt2", **{"data.tokenizer": f"hf:{hf_test.FIXTURES / 'gpt2'}"})
  config.model.init = f"hf:{d}"
  out["bad_dir[truncated-weights]"] = (config, "model.safetensors is truncated", errors.UserError)
  return out


def _documented_ids() -> set[str]:
  """The parametrized test ids docs/reliability.md's tables name (``config[...]``, ...)."""
  return set(
    re.findall(
      r"`((?:config|pipeline|data|tokenizer|bad_dir|hf_config|sft|late)\[[\w-]{2,}\])`",
      RELIABILITY.read_text(),
    )
  )


def test_every_documented_refusal_comes_before_any_write(tmp_path, monkeypatch, no_network):
  """The walk: each case in a fresh, empty data cache; its workdir is never created. The ids the
  page names must all be walked (a refusal documented but not walked fails here)."""
  cases = _walk_cases(tmp_path)
  missing = sorted(_documented_ids() - set(cases))
  assert not missing, f"docs/reliability.md names refusals the walk does not run: {missing}"
  monkeypatch.setattr(trainer.start_lib, "restore_or_init", _no_work)
  failed = []
  for i, (case, (config, match, error)) in enumerate(sorted(cases.items())):
    case_dir = tmp_path / f"case{i}"
    case_dir.mkdir()
    try:
      refused_before_any_write(config, match, case_dir, error)
    except (AssertionError, pytest.fail.Exception) as e:
      failed.append(f"{case}: {str(e).splitlines()[0]}")
  assert not failed, "\n".join(failed)


def _no_work(*args, **kwargs):
  """A case that reaches the state's restore or initialisation was not refused before the work."""
  raise AssertionError("reached restore_or_init: not refused before the work")
