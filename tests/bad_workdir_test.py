"""Bad input on an existing workdir: a run with another config, a corrupt checkpoint or a workdir
that is a file is a one-line error that changes nothing in the workdir (``bad_input_test``'s
helpers; ``docs/reliability.md`` lists the messages)."""

from __future__ import annotations

import hashlib
import logging
import pathlib
import shutil

import pytest

from acco_jax import model, parallel
from acco_jax.ckpt import checkpoint
from acco_jax.run import build, streams, trainer
from configs import gpt2_acco, gpt2_zero1
from tests.bad_input_test import one_line, tiny

# -- checkpoints: a workdir written with another config --------------------------------------------


def snapshot(workdir: pathlib.Path) -> dict:
  """Contents of the checkpoints and the metrics log, to show that a failed run changed nothing."""
  files = [p for p in sorted(workdir.rglob("*")) if p.is_file() and p.parts[-2] != "tb"]
  keep = [p for p in files if "checkpoints" in p.parts or p.name == "metrics.jsonl"]
  return {str(p.relative_to(workdir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in keep}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A workdir of the tiny ACCO config with checkpoints at stages 2 and 4 (of 4), made directly
  from the initial state (no step is compiled), and a line of metrics."""
  workdir = tmp_path_factory.mktemp("saved")
  config = tiny()
  run = build.build(config)
  rows = run.mesh.size * config.batch.microbatch_size
  prime = next(streams.batch_stream(run, config, run.tokens.train, rows, seed=1))
  state = run.step.init(model.init_params(run.model_cfg, 0), parallel.global_batch(prime, run.mesh))
  stream = streams.batch_stream(run, config, run.tokens.train, rows, seed=config.train.seed)
  with checkpoint.Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
    for stage in (2, 4):
      for _ in range(2):
        next(stream)
      extra = {"stage": stage, "data": stream.get_state(), "config": config.to_json_best_effort()}
      ckpt.save(stage, state, extra=extra)
  (workdir / "metrics.jsonl").write_text('{"step": 4, "stage": 4, "loss": 5.0}\n')
  return workdir


@pytest.fixture
def workdir(tmp_path, saved):
  shutil.copytree(saved, tmp_path / "run")
  return tmp_path / "run"


@pytest.mark.parametrize(
  "module,overrides,match",
  [
    (
      gpt2_acco,
      {"model.D": 128},
      r"it holds another model or optimizer: \.w is \[118592\], but "
      r"\[433792\] .*; resume with the config it was written with",
    ),
    (gpt2_acco, {"data.tokenizer": "bpe:512"}, r"it holds another model or optimizer"),
    (gpt2_acco, {"model.N": 3}, r"was written for a different state: target leaf .*\['2'\]"),
    (gpt2_zero1, {}, r"was written for a different state: target leaf \.opt_state"),
    (
      gpt2_acco,
      {"batch.microbatches": 4},
      r"the saved data position is for another stream, "
      r"\{'global_batch_rows': \(8, 16\)\}.*batch\.\*",
    ),
  ],
  ids=["wider-model", "other-tokenizer", "deeper-model", "other-method", "other-batch"],
)
def test_resuming_with_another_config_changes_nothing(workdir, module, overrides, match):
  before = snapshot(workdir)
  with pytest.raises(ValueError, match=match) as info:
    trainer.train_and_evaluate(tiny(module, **overrides), str(workdir))
  one_line(info.value)
  assert snapshot(workdir) == before


def test_bad_config_on_an_existing_workdir_changes_nothing(workdir):
  before = snapshot(workdir)
  with pytest.raises(ValueError, match="opt.name='adamx' is unknown"):
    trainer.train_and_evaluate(tiny(**{"opt.name": "adamx"}), str(workdir))
  assert snapshot(workdir) == before and not (workdir / "tb").exists()


def truncate_largest_array_file(step_dir: pathlib.Path):
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
  max(files, key=lambda p: p.stat().st_size).write_bytes(b"\x00" * 10)


@pytest.mark.slow  # trains after the fallback (the fallback itself: checkpoint_test)
def test_corrupt_latest_checkpoint_falls_back_and_trains_on(workdir, caplog):
  truncate_largest_array_file(workdir / "checkpoints" / "4")
  with caplog.at_level(logging.WARNING, logger="acco_jax.ckpt.checkpoint"):
    summary = trainer.train_and_evaluate(tiny(), str(workdir))
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any(w.startswith("checkpoint step 4 in ") and "trying an older one" in w for w in warnings)
  print(f"MESSAGE WARNING: {warnings[0]}")
  assert summary["stages"] == 4  # resumed at stage 2, ran stages 3 and 4
  assert '"event": "restored", "stage": 2' in (workdir / "metrics.jsonl").read_text()
  run = build.build(tiny())
  with checkpoint.Checkpointer(workdir / "checkpoints") as ckpt:  # the final state replaced step 4
    extra = ckpt.restore(4, run.step.abstract_state(run.params_shapes))[1]
  assert extra["stage"] == 4


def test_all_checkpoints_corrupt_is_an_error_that_deletes_nothing(workdir):
  for stage in (2, 4):
    truncate_largest_array_file(workdir / "checkpoints" / str(stage))
  before = snapshot(workdir)
  with pytest.raises(
    RuntimeError, match=r"no readable checkpoint in .*: steps \[2, 4\] are all"
  ) as info:
    trainer.train_and_evaluate(tiny(), str(workdir))
  one_line(info.value)
  assert snapshot(workdir) == before  # the damaged files are kept, e.g. for a salvage attempt


def test_workdir_that_is_a_file(tmp_path):
  (tmp_path / "run").write_text("not a directory")
  with pytest.raises(ValueError, match=r"workdir .* is a file"):
    trainer.train_and_evaluate(tiny(), str(tmp_path / "run"))
