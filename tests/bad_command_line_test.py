"""Bad input on the command line and in the environment: ``train.py`` in a subprocess prints one
line ``error: ...`` and exits 2 (they fail before JAX starts, or in XLA); ``docs/reliability.md``
lists the messages."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from acco_jax import optional
from acco_jax.run import build
from configs import gpt2_acco, gpt2_zero1
from tests.bad_input_test import CACHE, CONFIGS, REPO, one_line, tiny

# -- the command line and the environment (train.py in a subprocess) -------------------------------


def train_py(*args, env=None, timeout=120):
  """Runs train.py; returns its stderr, which must be one line ``error: ...`` with exit status 2."""
  base = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  proc = subprocess.run(
    [sys.executable, str(REPO / "train.py"), *args],
    capture_output=True,
    text=True,
    cwd=REPO,
    env={**base, **(env or {})},
    timeout=timeout,
  )
  assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  print(f"MESSAGE STDERR: {lines[0]}")
  return lines[0]


TINY = "configs/gpt2_acco.py:tiny"
CLI = [
  (
    "missing-config",
    ["--workdir", "W"],
    {},
    r"^error: flag --config=None: Flag --config must have a value other than None\.$",
  ),
  ("missing-workdir", ["--config", TINY], {}, r"^error: flag --workdir=None"),
  (
    "missing-config-file",
    ["--config", "configs/nope.py", "--workdir", "W"],
    {},
    r"^error: flag --config: \[Errno 2\] No such file or directory: 'configs/nope.py'$",
  ),
  (
    "unknown-preset",
    ["--config", "configs/gpt2_acco.py:huge", "--workdir", "W"],
    {},
    r"^error: flag --config=configs/gpt2_acco.py:huge: Error whilst parsing config file: "
    r"ValueError: unknown preset 'huge': choose one of cpu, tiny",
  ),
  (
    "unknown-override",
    ["--config", TINY, "--workdir", "W", "--config.nope=1"],
    {},
    r"^error: flag --config.nope: the config has no field 'nope' \(fields",
  ),
  (
    "misspelt-override",
    ["--config", TINY, "--workdir", "W", "--config.train.num_update=5"],
    {},
    r"^error: flag --config.train.num_update: the config has no field 'num_update'; Did you "
    r"mean \"num_updates\"",
  ),
  (
    "override-of-wrong-type",
    ["--config", TINY, "--workdir", "W", "--config.train.num_updates=x"],
    {},
    r"^error: flag --config.train.num_updates=x: invalid literal for int",
  ),
  (
    "stray-argument",
    ["--config", TINY, "--workdir", "W", "configs/gpt2_zero1.py"],
    {},
    r"^error: unexpected arguments: configs/gpt2_zero1.py; pass options as --config",
  ),
  (
    "dist-on-without-coordinator",
    ["--config", TINY, "--workdir", "W", "--config.dist.initialize=on"],
    {},
    r"^error: jax.distributed.initialize: coordinator_address should be defined. Set "
    r"dist.coordinator_address",
  ),
  (
    "coordinator-env-without-count",
    ["--config", TINY, "--workdir", "W"],
    {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"},
    r"^error: jax.distributed.initialize: Number of processes must be defined. Set",
  ),
  (
    "unknown-xla-flag",
    ["--config", TINY, "--workdir", "W"],
    {"XLA_FLAGS": "--xla_bogus_flag=1"},
    r"^error: Unknown flag in XLA_FLAGS: --xla_bogus_flag=1: remove or correct it in the XLA_FLAGS",
  ),
  (
    "hdee-unknown-mode",
    ["--config", "configs/hdee.py:tiny", "--workdir", "W", "--config.hdee.modes=steps,bogus"],
    {},
    r"^error: hdee.modes: unknown mode 'bogus': choose from homogeneous, steps, sizes$",
  ),
]


@pytest.mark.parametrize("args,env,match", [pytest.param(*c[1:], id=c[0]) for c in CLI])
def test_command_line_and_environment(tmp_path, args, env, match):
  line = train_py(*[str(tmp_path / "W") if a == "W" else a for a in args], env=env)
  assert re.search(match, line), line
  assert not (tmp_path / "W").exists()  # nothing was written


# Config and data cases of the in-process tests above, now through train.py: each must reach the
# terminal as exactly the exception's one line, exit status 2, with no workdir created. Cases from
# each place that raises (the method registry, the model's config, the mesh, the trainer's config
# checks), the three that once failed late among them (zero microbatch size, an unknown comm
# dtype, log_every=0); the data's: test_seq_len_longer_than_the_corpus_through_train_py. Every
# other message is checked in-process (bad_input_test) and reaches the terminal through the same
# handler in train.py.
THROUGH_TRAIN_PY = [
  "unknown-method",
  "heads-not-dividing-width",
  "negative-seq-len",
  "more-devices-than-visible",
  "zero-microbatch-size",
  "unknown-comm-dtype",
  "zero-log-every",
]


def _override(key, value):
  return f"--config.{key}={value}"


@pytest.mark.parametrize("case", THROUGH_TRAIN_PY)
def test_bad_config_through_train_py(tmp_path, case):
  overrides, error, match = next(c[1:4] for c in CONFIGS if c[0] == case)
  config = "configs/gpt2_zero1.py:tiny" if overrides.get("method") == "zero1" else TINY
  args = [_override(k, v) for k, v in overrides.items() if k != "method" or v != "zero1"]
  line = train_py(
    "--config",
    config,
    "--workdir",
    str(tmp_path / "W"),
    f"--config.data.cache_dir={CACHE}",
    "--config.train.num_updates=2",
    *args,
  )
  with pytest.raises(error, match=match) as info:  # the same message as in-process
    build.build(tiny(gpt2_zero1 if config != TINY else gpt2_acco, **overrides))
  assert line == f"error: {one_line(info.value)}"
  assert not (tmp_path / "W").exists()


def test_seq_len_longer_than_the_corpus_through_train_py(tmp_path):
  """Fails after the model and step are built, when the stream is packed: still nothing written."""
  line = train_py(
    "--config",
    TINY,
    "--workdir",
    str(tmp_path / "W"),
    f"--config.data.cache_dir={CACHE}",
    "--config.data.seq_len=10000000",
  )
  assert re.match(r"^error: a stream of \d+ tokens packs into 0 rows of seq_len\+1", line), line
  assert not (tmp_path / "W").exists()


def test_help_exits_zero():
  proc = subprocess.run(
    [sys.executable, str(REPO / "train.py"), "--help"],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    timeout=60,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "--config" in proc.stdout and "--workdir" in proc.stdout and not proc.stderr


@pytest.mark.skipif(optional.installed("jax_cuda12_plugin"), reason="CUDA is installed here")
def test_cuda_platform_without_cuda(tmp_path):
  line = train_py("--config", TINY, "--workdir", str(tmp_path), env={"JAX_PLATFORMS": "cuda"})
  assert line.startswith("error: JAX has no usable backend for JAX_PLATFORMS='cuda': "), line


def test_xla_flags_probe_runs_once_per_setting_that_passed(tmp_path, monkeypatch):
  """Flags the project does not know cost a child process once per jaxlib and setting, not per
  launch; a refused setting is never remembered; without a cache directory every launch probes."""
  from acco_jax import errors, parallel

  children = []

  def child(cmd, **kwargs):  # the probe: refuses what names 'bogus', as XLA would
    children.append(kwargs["env"]["XLA_FLAGS"])
    bad = "bogus" in kwargs["env"]["XLA_FLAGS"]
    stderr = "F1129 parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS: --xla_bogus=1\n"
    return subprocess.CompletedProcess(cmd, int(bad), "", stderr if bad else "")

  monkeypatch.setattr(parallel.subprocess, "run", child)

  def check(flags, cache=str(tmp_path / "cache")):
    monkeypatch.setenv("XLA_FLAGS", flags)
    parallel.check_xla_flags(remember_in=cache)

  check("--xla_force_host_platform_device_count=8")  # the project's own: no child
  assert children == []
  fast = "--xla_force_host_platform_device_count=8 --xla_cpu_enable_fast_math=false"
  check(fast)
  check(fast)
  check(" ".join(reversed(fast.split())))  # the same setting in another order
  assert children == [fast]
  check("--xla_cpu_enable_fast_math=true")  # another setting: probed
  assert len(children) == 2
  for _ in range(2):
    with pytest.raises(
      errors.UserError, match=r"^Unknown flag in XLA_FLAGS: --xla_bogus=1: remove"
    ):
      check("--xla_bogus=1")
  assert len(children) == 4
  check(fast, cache=None)
  check(fast, cache=None)
  assert len(children) == 6
