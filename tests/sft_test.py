"""Instruction fine-tuning through the trainer (configs/sft_acco.py:tiny): from a Hugging Face
directory and from a run of this project, held-out exact match printed and samples.jsonl written;
buckets compile one program each and nothing else; bad instruction files refused in one line
before anything is written."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest

from acco_jax import errors
from acco_jax.run import build, streams, trainer
from configs import sft_acco

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "data" / "hf"


# 200 examples "Reverse abc:" -> " cba" of 2 to 12 letters (lengths spread over buckets of 16)
REVERSALS = REPO / "tests" / "data" / "reversals.jsonl"


def tiny(tmp_path, **overrides):
  c = sft_acco.get_config("tiny")
  c.data.cache_dir = str(tmp_path / "cache")
  c.ckpt.async_save = False
  c.model.init = f"hf:{FIXTURES / 'gpt2'}"
  c.data.source, c.data.format = f"jsonl:{REVERSALS}", "prompt_completion"
  for key, value in overrides.items():
    group, _, field = key.rpartition(".")
    (c[group] if group else c)[field] = value
  return c


def test_fine_tunes_from_a_directory_and_from_a_run(tmp_path, capsys):
  """From a Hugging Face directory: the held-out exact match printed and samples.jsonl written;
  the 24 stages of batches in buckets of 16 trace their stage program once per width met (and
  kind of stage), not per step. Then a run starts from that run's committed weights."""
  from jax._src import dispatch

  from acco_jax.run import pretrained

  config = tiny(tmp_path, **{"train.num_updates": 12})
  run = build.build(config)
  stream = streams.batch_stream(run, config, run.tokens.train, 8, seed=config.train.seed)
  widths = {next(stream)["inputs"].shape[1] for _ in range(24)}  # the run's 24 stages
  assert widths <= {16, 32, 48} and len(widths) >= 2, widths
  traced, first = [], {}

  def on_event(event, _secs, **kw):
    if event == dispatch.JAXPR_TRACE_EVENT and kw.get("fun_name") == "stage":
      traced.append(event)

  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    summary = trainer.train_and_evaluate(config, str(tmp_path / "hf-start"), on_params=first.update)
  finally:
    jax.monitoring.unregister_event_duration_listener(on_event)
  assert len(widths) <= len(traced) <= 2 * len(widths), (len(traced), widths)
  out = capsys.readouterr().out
  assert "exact match" in out and "held-out prompts" in out
  assert 0.0 <= summary["exact_match"] <= 1.0 and summary["answer_prompts"] == 4
  samples = [
    json.loads(x) for x in (tmp_path / "hf-start" / "samples.jsonl").read_text().splitlines()
  ]
  assert len(samples) == 4 and all(s["prompt"].startswith("Reverse ") for s in samples)
  # model.init=run:<that workdir>: its committed weights, bit for bit (the trainer then runs as
  # from a directory, at update 0 with a fresh optimizer)
  config = tiny(tmp_path, **{"model.init": f"run:{tmp_path / 'hf-start'}"})
  run = build.build(config)
  start = pretrained.load_params(config, run.model_cfg, run.mesh)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(start), jax.device_get(first))


BAD = {
  "malformed-line": (
    '{"prompt": "a", "completion": "b"}\n{"prompt": "a",\n',
    r"rev2.jsonl:2: not a JSON object",
  ),
  "missing-field": ('{"prompt": "a"}\n', r"rev2.jsonl:1: field 'completion' is missing"),
  "empty-response": ('{"prompt": "a", "completion": ""}\n', r"rev2.jsonl:1: the response is empty"),
  "none-left-after-split": (
    '{"prompt": "a", "completion": "b"}\n',
    r"1 example\(s\) leave none to hold out or none to train on",
  ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_instruction_file_is_one_line_and_writes_nothing(case, tmp_path):
  text, match = BAD[case]
  (tmp_path / "rev2.jsonl").write_text(text)
  config = tiny(tmp_path, **{"data.source": f"jsonl:{tmp_path / 'rev2.jsonl'}"})
  with pytest.raises(errors.UserError, match=match) as info:
    trainer.train_and_evaluate(config, str(tmp_path / "workdir"))
  assert "\n" not in str(info.value)
  print(f"MESSAGE {type(info.value).__name__}: {info.value}")
  assert not (tmp_path / "workdir").exists()


def test_packing_is_refused_where_rows_run_as_one_sequence(tmp_path):
  config = tiny(tmp_path, **{"method": "pipeline", "data.packing": True})
  with pytest.raises(errors.UserValueError, match="data.packing=True: the pipeline's stages"):
    build.build(config)


def test_export_writes_floats_as_the_source_did_and_its_stop_ids(tmp_path):
  """config.json's floats as the source's config.json wrote them (the same float32 value), others
  as the run's config; generation_config.json's eos ids the end-of-text and end-of-turn, the
  source's bos, pad and sampling settings kept (written out by hand)."""
  from acco_jax import hf

  ours = {"rms_norm_eps": 1e-05, "initializer_range": 0.02, "rope": {"theta": 10000.0}}
  theirs = {
    "rms_norm_eps": 9.999999747378752e-06,
    "initializer_range": 0.03,
    "rope": {"theta": 10000},
  }
  assert hf.as_source_wrote(ours, theirs) == {
    "rms_norm_eps": 9.999999747378752e-06,  # float32(1e-5): as the source wrote it
    "initializer_range": 0.02,  # another value: the run's
    "rope": {"theta": 10000},
  }
  (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "pad_token_id": 2}))
  (tmp_path / "generation_config.json").write_text(
    json.dumps({"eos_token_id": 7, "temperature": 0.2, "transformers_version": "5.0"})
  )
  assert hf.generation_config((2, 9), 5, str(tmp_path)) == {
    "eos_token_id": [2, 9, 7],
    "temperature": 0.2,
    "bos_token_id": 1,
    "pad_token_id": 2,
  }
  assert hf.generation_config((3,), 3) == {"eos_token_id": 3, "bos_token_id": 3}
