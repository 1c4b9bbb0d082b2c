"""The HDEE recipe end to end at tiny scale: one command's jobs, results, and resume after a kill."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from acco_jax.ensemble import budgets, jobs, mixing, recipe
from acco_jax.run import trainer
from configs import hdee

REPO = pathlib.Path(__file__).resolve().parent.parent
CACHE = REPO / ".pytest_cache" / "acco_data"


def tiny(**overrides):
  """Two experts of one size (mode 'steps'), one iteration each, and a held-out domain each."""
  c = hdee.get_config("tiny")
  c.data.cache_dir = str(CACHE)
  c.ckpt.async_save = False
  c.hdee.modes = "steps"
  c.hdee.domains = "hard:1:code_asyncio,hard:0:code_unittest,easy:1:kjv_law,easy:0:kjv_gospels"
  c.hdee.budget_flops = 1.5e9
  c.train.sample_tokens = 0
  for key, value in overrides.items():
    group, _, field = key.rpartition(".")
    (c[group] if group else c)[field] = value
  return c


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("hdee") / "straight")
  return workdir, recipe.train_and_evaluate(tiny(), workdir)


def test_one_command_runs_seed_experts_and_evaluation(straight):
  workdir, results = straight
  names = [j["name"] for j in results["plan"]]
  assert names == ["seed-M", "steps/hard-1", "steps/easy-1"]
  steps = {j["name"]: j["steps"] for j in results["plan"]}
  hard, easy = steps["steps/hard-1"], steps["steps/easy-1"]
  assert 3 * easy <= hard < 3 * (easy + 1)  # step weights 1.5 : 0.5, each rounded down
  for name in names:
    assert os.path.isfile(os.path.join(workdir, name, "params.npz"))
  ppl = results["ppl"]["M_Ho-I_He"]
  assert set(ppl) == set(mixing.RULES)
  domains = ["code_asyncio", "code_unittest", "kjv_law", "kjv_gospels"]
  for rule in mixing.RULES:
    assert set(ppl[rule]) == set(domains) and all(1 < v < 300 for v in ppl[rule].values())
  experts = results["experts"]["M_Ho-I_He"]
  for d in domains:  # the posterior mixture is never much worse than its best expert
    best = min(e[d] for e in experts.values())
    assert ppl["uniform_prior"][d] < best * 1.05
  assert os.path.isfile(os.path.join(workdir, "results.md"))
  assert budgets.MODE_LABELS["steps"] in open(os.path.join(workdir, "results.md")).read()


def _command(workdir: pathlib.Path) -> list[str]:
  """``train.py`` with the ``tiny()`` recipe, a checkpoint every stage and every stage logged."""
  flags = {
    "data.cache_dir": CACHE,
    "ckpt.async_save": False,
    "hdee.modes": "steps",
    "hdee.domains": tiny().hdee.domains,
    "hdee.budget_flops": 1.5e9,
    "train.sample_tokens": 0,
    "ckpt.every": 1,
    "train.log_every": 1,
  }
  return [
    sys.executable,
    str(REPO / "train.py"),
    "--config",
    "configs/hdee.py:tiny",
    "--workdir",
    str(workdir),
    *(f"--config.{k}={v}" for k, v in flags.items()),
  ]


def _saved_stages(checkpoints: pathlib.Path) -> list[int]:
  """Finished checkpoints (orbax renames a step's temporary folder to its number when done)."""
  if not checkpoints.is_dir():
    return []
  return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


@pytest.mark.slow  # a SIGKILLed train.py and its rerun (the recipe's e2e runs in the fast set)
def test_recipe_resumes_after_a_kill(straight, tmp_path):
  """SIGKILL train.py inside the first expert's job; the same command finishes the recipe."""
  _, expected = straight
  workdir = tmp_path / "killed"
  job = workdir / "steps" / "hard-1"
  with open(tmp_path / "killed.log", "w") as log:
    proc = subprocess.Popen(_command(workdir), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and not _saved_stages(job / "checkpoints"):
      time.sleep(0.05)
    proc.kill()  # no handler runs: whatever the job was writing stays half-done
    proc.wait()
  assert _saved_stages(job / "checkpoints"), (tmp_path / "killed.log").read_text()[-3000:]
  assert (workdir / "seed-M" / "params.npz").is_file()
  assert not (job / "params.npz").exists() and not (workdir / "results.json").exists()

  rerun = subprocess.run(_command(workdir), cwd=REPO, capture_output=True, text=True)
  assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
  assert "hdee: seed-M" not in rerun.stdout  # the finished seed is not trained again
  events = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]
  restored = [e for e in events if e.get("event") == "restored"]
  assert restored and restored[-1]["stage"] >= 1  # the expert went on from its checkpoint
  results = json.loads((workdir / "results.json").read_text())
  # The same programs from the same states, in another process: the test's own recipe is the
  # reference; a job retrained from the wrong parameters or data moves these by far more.
  for label in expected["ppl"]:
    np.testing.assert_allclose(
      _flat(results["ppl"][label]), _flat(expected["ppl"][label]), rtol=1e-5, err_msg=label
    )
  with pytest.raises(ValueError, match=r"holds an HDEE recipe with another config \(hdee.budget_"):
    recipe.train_and_evaluate(tiny(**{"hdee.budget_flops": 3e9}), str(workdir))


def _flat(tree) -> list[float]:
  return [float(v) for v in jax.tree.leaves(tree)]


def test_a_job_starts_from_its_parents_parameters(straight, tmp_path):
  """One step from init_params = 2 x the seed (no random init is near it) stays near it."""
  workdir, _ = straight
  plan = recipe.make_plan(tiny())
  cfg = plan.model_cfgs["M"]
  start = jax.tree.map(lambda x: 2 * x, jobs.load_params(f"{workdir}/seed-M/params.npz", cfg))
  job = budgets.Job("one", "M", "kjv_law", 1, 0.0, "seed-M")
  got = []
  trainer.train_and_evaluate(
    jobs.job_config(tiny(), job, plan.source_of["kjv_law"], plan.sizes["M"]),
    str(tmp_path / "one"),
    init_params=start,
    on_params=got.append,
  )
  sq = lambda t: sum(float(np.sum(np.square(x))) for x in jax.tree.leaves(t))  # noqa: E731
  moved = sq(jax.tree.map(lambda a, b: np.asarray(a) - b, got[0], start)) / sq(start)
  assert moved < 1e-3, moved  # one AdamW step of lr <= 2e-3 per weight


def test_jobs_split_over_runs_sharing_a_workdir(straight, tmp_path, capsys):
  """hdee.jobs: the seed, then the hard chain, then the rest, as three runs (processes or hosts
  sharing the workdir would do the same); the last one evaluates, with the straight run's numbers
  (the same programs on the same states, in this process)."""
  _, expected = straight
  workdir = str(tmp_path / "split")
  assert recipe.train_and_evaluate(tiny(**{"hdee.jobs": "seed-*"}), workdir) == {}
  assert "2 job(s) of the recipe are not: steps/hard-1, steps/easy-1" in capsys.readouterr().out
  assert not os.path.exists(os.path.join(workdir, "steps"))
  assert recipe.train_and_evaluate(tiny(**{"hdee.jobs": "steps/hard-*"}), workdir) == {}
  out = capsys.readouterr().out
  assert "hdee: seed-M" not in out and "1 job(s) of the recipe are not: steps/easy-1" in out
  assert os.path.isfile(os.path.join(workdir, "steps", "hard-1", "params.npz"))
  results = recipe.train_and_evaluate(tiny(), workdir)
  assert "hdee: steps/easy-1" in capsys.readouterr().out
  assert results["ppl"] == expected["ppl"]  # same programs, same states: bit for bit


@pytest.mark.parametrize(
  "selection,match",
  [
    ("steps/hard-*,stepz/*", r"^hdee.jobs: 'stepz/\*' matches no job of this recipe \(seed-M, "),
    ("steps/easy-*", r"^hdee.jobs: job 'steps/easy-1' starts from 'seed-M', which is neither done"),
  ],
  ids=["glob-matching-nothing", "parent-not-done"],
)
def test_bad_job_selection_writes_nothing(selection, match, tmp_path):
  """Refused before any domain's data is prepared (an empty data cache stays empty) and before
  anything is written."""
  config = tiny(**{"hdee.jobs": selection, "data.cache_dir": str(tmp_path / "cache")})
  with pytest.raises(ValueError, match=match) as info:
    recipe.train_and_evaluate(config, str(tmp_path / "W"))
  assert "\n" not in str(info.value)
  assert not (tmp_path / "W").exists()
  assert not list((tmp_path / "cache").rglob("*")), "data was prepared before the refusal"


def test_every_job_exports_to_hugging_face(straight, tmp_path):
  """``python -m acco_jax.export`` of a recipe writes each job (seed, experts) as a Hugging Face
  directory holding exactly the job's final parameters (its ``params.npz``)."""
  from acco_jax import export, hf

  workdir, results = straight
  written = export.export(workdir, str(tmp_path / "hf"))
  assert [pathlib.Path(w).relative_to(tmp_path / "hf").as_posix() for w in written] == sorted(
    j["name"] for j in results["plan"]
  )
  plan = recipe.make_plan(tiny())
  for job in results["plan"]:
    cfg = plan.model_cfgs[job["size"]]
    want = jobs.load_params(os.path.join(workdir, job["name"], "params.npz"), cfg)
    got = hf.load_params(str(tmp_path / "hf" / job["name"]), cfg)
    jax.tree.map(np.testing.assert_array_equal, got, want)
