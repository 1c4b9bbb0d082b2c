"""method=pipeline through the trainer: a SkipPipe schedule on 2 data lanes x 4 stages (8 simulated
devices) trains, checkpoints its stage-sharded state and resumes on the identical trajectory (the same
program reruns, so bit-exact)."""

import json
import pathlib

import jax

from acco_jax.run import trainer
from configs import gpt2_pipeline


def _config():
  config = gpt2_pipeline.get_config("tiny")
  config.data.cache_dir = str(pathlib.Path(__file__).parent / ".." / ".pytest_cache" / "acco_data")
  config.ckpt.async_save = False
  config.pipeline.schedule = "skippipe"
  config.train.num_updates, config.train.log_every = 4, 1
  config.train.eval_every, config.train.eval_batches, config.train.sample_tokens = 0, 1, 0
  return config


def _losses(workdir):
  lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
  return {r["stage"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_skippipe_pipeline_trains_and_resumes_bit_exactly(tmp_path):
  config = _config()
  whole = trainer.train_and_evaluate(config, str(tmp_path / "whole"))
  first = trainer.train_and_evaluate(config, str(tmp_path / "split"), max_stages=2)
  assert first["stopped"] == 2
  second = trainer.train_and_evaluate(config, str(tmp_path / "split"))
  assert len(_losses(tmp_path / "whole")) == 4
  assert _losses(tmp_path / "split") == _losses(tmp_path / "whole")
  assert second["eval_loss"] == whole["eval_loss"]
  losses = _losses(tmp_path / "whole")
  assert losses[4] < losses[1]
  # the state a step carries holds each stage's blocks on that stage's devices
  run = trainer.build(config)
  state = run.train.abstract_state(run.params_shapes)
  spec = jax.tree.leaves(state.params["blocks"])[0].sharding.spec
  assert spec[0] == "stage", spec
