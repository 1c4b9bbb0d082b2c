"""Hugging Face checkpoints in and out, against transformers' own logits (no torch needed here).

``tests/data/hf/<arch>/`` holds a random tiny model of each architecture as transformers wrote it
and the logits transformers gives for fixed tokens (``tests/hf_fixtures.py``; the ``hf_live``
tests rebuild them with the installed transformers). Here: each loads and gives those logits; the
comparison fails on a deliberate mapping error (each mistake the peers' users reported); a run
starts from a directory and exports one that reads back; bad directories and configs are refused
in one line before anything is prepared or written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acco_jax import errors, hf, model
from acco_jax.models import base, gpt_neo, qwen2, qwen3
from acco_jax.run import trainer
from configs import gpt2_acco

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "data" / "hf"
CACHE = REPO / ".pytest_cache" / "acco_data"
ARCHS = ("gpt2", "gpt_neo", "llama", "llama3", "llama_linear", "qwen2", "qwen3", "mistral")
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 on any x86-64 CPU (measured: 2e-6 here)


def _logits(directory, tokens):
  cfg = hf.model_config(str(directory), dtype="float32")
  params = hf.load_params(str(directory), cfg)
  return np.asarray(jax.jit(lambda p, t: model.apply(p, cfg, t))(params, jnp.asarray(tokens)))


def _reference(name):
  with np.load(FIXTURES / name / "reference.npz") as f:
    return f["tokens"], f["logits"]


@pytest.mark.parametrize("name", ARCHS)
def test_checkpoint_gives_transformers_logits(name):
  tokens, want = _reference(name)
  np.testing.assert_allclose(_logits(FIXTURES / name, tokens), want, **TOL)


def test_fixtures_cover_what_a_mapping_can_get_wrong():
  """The fixtures are the cases the module docstring of tests/hf_fixtures.py names."""
  neo = hf.model_config(str(FIXTURES / "gpt_neo"))
  assert neo.window < _reference("gpt_neo")[0].shape[1] and "local" in gpt_neo.layer_types(neo)
  assert (FIXTURES / "gpt_neo" / hf.INDEX).is_file()  # sharded weights
  lla = hf.model_config(str(FIXTURES / "llama"))
  assert lla.num_kv_heads < lla.H and not lla.tied_head and lla.rope_theta != 10000.0
  llama3 = hf.model_config(str(FIXTURES / "llama3"))  # one frequency kept, one mixed, two divided
  wavelength = 2 * np.pi / _FREQUENCIES(dataclasses.replace(llama3, rope_type="default"))
  low, high = (llama3.rope_original_L / f for f in (0.5, 4.0))
  assert [int(np.sum(m)) for m in (wavelength < high, wavelength > low)] == [1, 2]
  assert hf.model_config(str(FIXTURES / "llama_linear")).rope_type == "linear"
  qwen3_cfg = hf.model_config(str(FIXTURES / "qwen3"))
  assert qwen3_cfg.head_dim * qwen3_cfg.H != qwen3_cfg.D and not qwen3_cfg.tied_head
  assert hf.model_config(str(FIXTURES / "qwen2")).tied_head
  mistral = hf.model_config(str(FIXTURES / "mistral"))
  assert mistral.layer_types == "local" and mistral.window < _reference("mistral")[0].shape[1]
  dtypes = {e.dtype for e in hf.tensor_index(str(FIXTURES / "llama")).values()}
  assert dtypes == {np.dtype(jnp.bfloat16)}
  params = hf.load_params(str(FIXTURES / "gpt2"), hf.model_config(str(FIXTURES / "gpt2")))
  block = params["blocks"]["0"]
  assert np.std(block["attn_qkv"]["bias"]) > 0.1 and np.std(block["ln_1"]["scale"]) > 0.1
  for name, leaves in (("qwen2", ("attn_k", "bias")), ("qwen3", ("attn_q_norm", "scale"))):
    params = hf.load_params(str(FIXTURES / name), hf.model_config(str(FIXTURES / name)))
    assert np.std(params["blocks"]["1"][leaves[0]][leaves[1]]) > 0.1, name


# -- the comparison fails on each mapping error ----------------------------------------------------


def _interleaved_rope(x_BxLxHxK, positions_BxL, inv_freq):
  """RoPE read the other way: features (2i, 2i+1) as the pairs, not (i, i + K/2)."""
  K = x_BxLxHxK.shape[-1]
  angle = positions_BxL.astype(jnp.float32)[..., None, None] * inv_freq
  x = x_BxLxHxK.astype(jnp.float32).reshape(*x_BxLxHxK.shape[:-1], K // 2, 2)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  out = jnp.stack([x[..., 0] * cos - x[..., 1] * sin, x[..., 0] * sin + x[..., 1] * cos], -1)
  return out.reshape(x_BxLxHxK.shape).astype(x_BxLxHxK.dtype)


_ATTENTION = base.attention


def _scaled_attention(q, k, v, cfg, *, scale=None, **kwargs):
  """GPT-Neo's scores scaled by 1/sqrt(K), as every other GPT is."""
  return _ATTENTION(q, k, v, cfg, scale=None, **kwargs)


def _swap_q_k(tensors):
  def swapped(cfg):
    out = []
    for t in tensors(cfg):
      name = t.name.replace("q_proj", "@").replace("k_proj", "q_proj").replace("@", "k_proj")
      out.append(t._replace(name=name))
    return out

  return swapped


_FREQUENCIES = base.rope_frequencies


def _rope_read_as(rope_type):
  """RoPE's frequencies scaled as ``rope_type``, whatever the config says."""
  return lambda cfg: _FREQUENCIES(dataclasses.replace(cfg, rope_type=rope_type))


def _window_plus_one(q, k, v, cfg, *, window=None, **kwargs):
  """A sliding window one key wider than the config's."""
  return _ATTENTION(q, k, v, cfg, window=None if window is None else window + 1, **kwargs)


def _swap_names(module, a, b):
  """``module.hf_tensors`` with the tensors named ``...a`` and ``...b`` read in each other's place."""
  tensors = module.hf_tensors

  def swapped(cfg):
    out = []
    for t in tensors(cfg):
      name = t.name.replace(a, "@").replace(b, a).replace("@", b)
      out.append(t._replace(name=name))
    return out

  return swapped


MUTANTS = {
  "rope-interleaved": ("llama", lambda mp: mp.setattr(base, "rotate", _interleaved_rope)),
  "llama3-read-as-linear": (
    "llama3",
    lambda mp: mp.setattr(base, "rope_frequencies", _rope_read_as("linear")),
  ),
  "rope-scaling-ignored": (
    "llama_linear",
    lambda mp: mp.setattr(base, "rope_frequencies", _rope_read_as("default")),
  ),
  "qwen2-k-v-bias-swapped": (
    "qwen2",
    lambda mp: mp.setattr(qwen2, "hf_tensors", _swap_names(qwen2, "k_proj.bias", "v_proj.bias")),
  ),
  "qwen3-q-k-norm-swapped": (
    "qwen3",
    lambda mp: mp.setattr(qwen3, "hf_tensors", _swap_names(qwen3, "q_norm", "k_norm")),
  ),
  "mistral-window-off-by-one": (
    "mistral",
    lambda mp: mp.setattr(base, "attention", _window_plus_one),
  ),
  "neo-scaled-scores": ("gpt_neo", lambda mp: mp.setattr(base, "attention", _scaled_attention)),
  "q-k-swapped": (
    "gpt_neo",
    lambda mp: mp.setattr(gpt_neo, "hf_tensors", _swap_q_k(gpt_neo.hf_tensors)),
  ),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_each_mapping_error_fails_the_comparison(mutant, monkeypatch):
  name, apply = MUTANTS[mutant]
  tokens, want = _reference(name)
  apply(monkeypatch)
  got = _logits(FIXTURES / name, tokens)
  with pytest.raises(AssertionError):
    np.testing.assert_allclose(got, want, **TOL)
  assert np.max(np.abs(got - want)) > 100 * TOL["atol"]


# -- RoPE scaling in both config dialects; what is not run is refused ----------------------------------


def _as_transformers4(directory, **rope_scaling):
  """``directory``'s config.json as transformers 4.x wrote it: ``rope_theta`` at the top level and
  the scaling in ``rope_scaling``, no ``rope_parameters``."""
  path = directory / hf.CONFIG
  config = json.loads(path.read_text())
  params = config.pop("rope_parameters")
  config["rope_theta"] = params["rope_theta"]
  config["rope_scaling"] = rope_scaling
  path.write_text(json.dumps(config))


DIALECTS = {  # fixture: its scaling as a transformers 4.x config.json wrote it
  "llama3": dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=0.5,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
  ),
  "llama_linear": dict(type="linear", factor=4.0),  # 'type': the oldest files' key
}


@pytest.mark.parametrize("name", DIALECTS)
def test_transformers4_rope_scaling_gives_the_same_logits(name, tmp_path):
  directory = _copy(tmp_path, name)
  _as_transformers4(directory, **DIALECTS[name])
  cfg = hf.model_config(str(directory))
  assert cfg.rope_type == name.removeprefix("llama_") and cfg.rope_theta == 5000.0
  tokens, want = _reference(name)
  np.testing.assert_allclose(_logits(directory, tokens), want, **TOL)


UNRUN = {  # fixture, config.json edits: the refusal
  "rope-dynamic": (
    "llama",
    {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5000.0, "factor": 2.0}},
    "scales its rotary positions with rope_type='dynamic', which acco_jax does not run",
  ),
  "rope-yarn-4.x": (
    "qwen2",
    {"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 4.0}},
    "rope_type='yarn', which acco_jax does not run",
  ),
  "rope-partial": (
    "mistral",
    {"partial_rotary_factor": 0.5},
    "rotates only part of each head \\(partial_rotary_factor=0.5\\)",
  ),
  "qwen2-sliding-window": (
    "qwen2",
    {"use_sliding_window": True},
    "qwen2 checkpoint has use_sliding_window=True, which acco_jax does not run",
  ),
  "qwen3-attention-bias": (
    "qwen3",
    {"attention_bias": True},
    "qwen3 checkpoint has attention_bias=True, which acco_jax does not run",
  ),
  "mistral-layer-types": (
    "mistral",
    {"layer_types": ["sliding_attention", "full_attention"]},
    "this mistral checkpoint sets layer_types",
  ),
}


@pytest.mark.parametrize("case", UNRUN)
def test_what_is_not_run_is_refused_in_one_line(case, tmp_path):
  name, changes, match = UNRUN[case]
  directory = _copy(tmp_path, name)
  _edit_config(directory, **changes)
  with pytest.raises(errors.UserValueError, match=match) as info:
    hf.model_config(str(directory))
  assert "\n" not in str(info.value)


def test_exported_config_reads_back_the_same_model(tmp_path):
  """Each fixture's model written as a config.json (to_hf_config) reads back as itself."""
  for name in ARCHS:
    cfg = hf.model_config(str(FIXTURES / name))
    (tmp_path / name).mkdir()
    (tmp_path / name / hf.CONFIG).write_text(json.dumps(hf.hf_config(cfg)))
    assert hf.model_config(str(tmp_path / name)) == cfg, name


# -- a run starts from a directory; its export reads back --------------------------------------------


def _hf_config(name, **overrides):
  config = gpt2_acco.get_config("tiny")
  config.data.cache_dir = str(CACHE)
  config.ckpt.async_save = False
  config.train.sample_tokens, config.train.eval_every = 0, 0
  config.model.init, config.model.size = f"hf:{FIXTURES / name}", "init"
  config.data.tokenizer, config.model.dtype = "init", "float32"
  for key, value in overrides.items():
    group, _, field = key.rpartition(".")
    (config[group] if group else config)[field] = value
  return config


def test_a_run_starts_from_the_checkpoint_and_exports_what_it_trained(tmp_path):
  """update 0 evaluates the checkpoint's own parameters; after training, the export holds the
  trained ones (our reader of the export gives the trained model's logits) with the tokenizer."""
  from acco_jax import data
  from acco_jax import export as export_lib

  got = {}
  config = _hf_config("llama", **{"train.num_updates": 2})
  summary = trainer.train_and_evaluate(config, str(tmp_path / "run"), on_params=got.update)
  assert summary["updates"] == 2
  events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert any(e.get("event") == "pretrained" for e in events)
  out = tmp_path / "exported"
  export_lib.export(str(tmp_path / "run"), str(out))
  tokens, start = _reference("llama")
  trained = jax.tree.map(np.asarray, got)
  cfg = hf.model_config(str(out), dtype="float32")
  want = np.asarray(model.apply(trained, cfg, jnp.asarray(tokens)))
  np.testing.assert_allclose(_logits(out, tokens), want, **TOL)
  assert np.max(np.abs(want - start)) > 1e-3, "training did not move the parameters"
  ours = data.get_tokenizer(f"hf:{FIXTURES / 'llama'}")
  theirs = data.get_tokenizer(f"hf:{out}")
  text = "And God said, Let there be light"
  assert theirs.encode(text) == ours.encode(text) and theirs.eot_id == ours.eot_id


# -- bad input: one line, nothing prepared or written -------------------------------------------------


def _copy(tmp_path, name="gpt2") -> pathlib.Path:
  target = tmp_path / f"hf-{name}"
  shutil.copytree(FIXTURES / name, target)
  return target


def _edit_config(directory, **changes):
  path = directory / hf.CONFIG
  config = json.loads(path.read_text())
  config.update(changes)
  path.write_text(json.dumps(config))


def _rewrite_weights(directory, edit):
  from safetensors.numpy import save_file

  index = hf.tensor_index(str(directory))
  tensors = {name: np.array(hf._read(entry)) for name, entry in index.items()}
  edit(tensors)
  save_file(tensors, str(directory / hf.WEIGHTS), metadata={"format": "pt"})


def _bad_dir(tmp_path, case) -> pathlib.Path:
  """A copy of a fixture with one thing wrong (the ``BAD_DIRS`` case)."""
  d = _copy(tmp_path, "llama" if case == "no-weights" else "gpt2")
  if case == "no-config":
    (d / hf.CONFIG).unlink()
  elif case == "no-weights":
    (d / hf.WEIGHTS).unlink()
  elif case == "unknown-model-type":
    _edit_config(d, model_type="bert")
  elif case == "tensor-missing":
    _rewrite_weights(d, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))
  elif case == "tensor-left-over":
    _rewrite_weights(
      d, lambda t: t.update({"transformer.h.2.ln_1.weight": np.ones(32, np.float32)})
    )
  elif case == "shape-disagrees":
    _edit_config(d, n_inner=64)
  return d


BAD_DIRS = {
  "no-config": "has no config.json",
  "no-weights": "has no model.safetensors or model.safetensors.index.json",
  "unknown-model-type": "model_type 'bert' is not supported: acco_jax runs gpt2, gpt_neo, llama, "
  "qwen2, qwen3, mistral",
  "tensor-missing": "tensor transformer.h.1.mlp.c_fc.bias is missing",
  "tensor-left-over": "tensors transformer.h.2.ln_1.weight are not part of a gpt2 model",
  "shape-disagrees": r"tensor transformer.h.0.mlp.c_fc.weight has shape \[32, 128\], config.json implies \[32, 64\]",
}


def _refused(config, match, tmp_path):
  config.data.cache_dir = str(tmp_path / "cache")
  with pytest.raises(errors.UserError, match=match) as info:
    trainer.train_and_evaluate(config, str(tmp_path / "workdir"))
  message = str(info.value)
  assert "\n" not in message, message
  print(f"MESSAGE {type(info.value).__name__}: {message}")  # docs/reliability.md
  assert not (tmp_path / "workdir").exists(), "the workdir was written before the refusal"
  assert not list((tmp_path / "cache").rglob("*")), "data was prepared before the refusal"


@pytest.mark.parametrize("case", BAD_DIRS)
def test_bad_directory_is_refused_in_one_line(case, tmp_path):
  directory = _bad_dir(tmp_path, case)
  config = _hf_config("gpt2")
  config.model.init = f"hf:{directory}"
  config.data.tokenizer = f"hf:{FIXTURES / 'gpt2'}"  # the directory's own may be what is broken
  _refused(config, BAD_DIRS[case], tmp_path)


BAD_CONFIGS = {
  "tokenizer-larger-than-embedding": (
    {"data.tokenizer": "gpt2"},
    "gives 50257 ids, more than the 318 rows of the checkpoint",
  ),
  "size-contradicts-checkpoint": (
    {"model.D": 64},
    r"model.D=64 \(config.json: 32\) do not match the checkpoint: set --config.model.size=init",
  ),
  "preset-contradicts-checkpoint": (
    {"model.size": "tiny", "model.arch": "gpt2"},
    r"model.D=64 \(config.json: 32\); model.F=256 \(config.json: 128\)",
  ),
  "arch-contradicts-checkpoint": (
    {"model.size": "tiny", "model.arch": "llama"},
    r"model.arch=llama \(config.json: gpt2\)",
  ),
  "corpus-tokenizer": (
    {"data.tokenizer": "bpe:2048"},
    "their embedding reads the ids of their own",
  ),
  "longer-than-positions": (
    {"data.seq_len": 65},
    "data.seq_len=65 is longer than the 64 positions",
  ),
  "not-hf": ({"model.init": "runs/acco"}, "model.init='runs/acco': give hf:<dir>"),
  "size-hf-without-init": ({"model.init": ""}, "model.size=init takes the sizes from model.init"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_config_with_a_checkpoint_is_refused_in_one_line(case, tmp_path):
  overrides, match = BAD_CONFIGS[case]
  config = _hf_config("gpt2", **overrides)
  if not config.model.init:
    config.data.tokenizer = "byte"
  _refused(config, match, tmp_path)


def test_export_refuses_a_directory_that_is_not_empty_and_writes_nothing(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  with pytest.raises(errors.UserValueError, match="exists and is not empty"):
    hf.save(str(out), {}, hf.model_config(str(FIXTURES / "gpt2")))
  assert os.listdir(out) == ["keep.txt"] and os.listdir(tmp_path) == ["out"]


def test_export_command_refuses_in_one_line(tmp_path):
  result = subprocess.run(
    [sys.executable, "-m", "acco_jax.export", str(tmp_path / "none"), str(tmp_path / "out")],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=120,
  )
  assert result.returncode == 2, result.stderr
  assert result.stderr.strip().splitlines() == [
    f"error: {tmp_path / 'none'}: no such directory: give a run's workdir"
  ]
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
  "method,overrides",
  [
    ("diloco", {"loco.workers": 4, "loco.sync_every": 2}),
    ("pipeline", {"pipeline.stages": 2, "pipeline.data_method": "zero1"}),
  ],
)
def test_loco_and_pipeline_runs_export_their_global_parameters(method, overrides, tmp_path):
  """A LoCo run exports θ_g (what its evaluation reads, the same on every worker), a pipeline
  every stage's blocks gathered: the export reads back as the run's final parameters exactly."""
  from acco_jax import export as export_lib
  from configs import gpt2_diloco, gpt2_pipeline

  module = gpt2_diloco if method == "diloco" else gpt2_pipeline
  config = module.get_config("tiny")
  config.data.cache_dir = str(CACHE)
  config.ckpt.async_save, config.train.sample_tokens, config.train.eval_every = False, 0, 0
  config.model.D, config.model.H, config.model.N, config.data.seq_len = 16, 2, 2, 16
  config.train.num_updates = 4
  for key, value in overrides.items():
    group, field = key.split(".")
    config[group][field] = value
  got = {}
  trainer.train_and_evaluate(config, str(tmp_path / "run"), on_params=got.update)
  (out,) = export_lib.export(str(tmp_path / "run"), str(tmp_path / "hf"))
  cfg = hf.model_config(out)
  exported = hf.load_params(out, cfg)
  jax.tree.map(np.testing.assert_array_equal, exported, jax.tree.map(np.asarray, got))
