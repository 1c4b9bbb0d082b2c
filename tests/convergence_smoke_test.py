"""Smoke tests of the convergence benchmarks (bench.dp.convergence, bench.dp.quadratic).

The full benchmarks take about an hour; CI runs ``convergence.py --smoke`` (tiny model, 2 devices,
zero1 and acco, 2 updates, each run its own process) and checks the structure and finiteness of its
JSON, checks the collection arithmetic on synthetic runs, and runs ``quadratic.py`` in its small mode.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.dp import convergence, convergence_settings, quadratic

REPO = Path(__file__).resolve().parent.parent


def _finite(xs):
  return all(isinstance(x, int | float) and math.isfinite(x) for x in xs)


@pytest.mark.slow
def test_convergence_smoke(tmp_path):
  proc = subprocess.run(
    [sys.executable, "-m", "bench.dp.convergence", "--smoke", "--out", str(tmp_path)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads((tmp_path / "convergence_smoke.json").read_text())
  assert {"machine", "settings", "assumptions", "wall_s"} <= set(res)
  smoke = res["settings"]["smoke"]
  cfg = convergence_settings.SETTINGS["smoke"]
  assert smoke["config"]["tokens_per_update"] == convergence_settings.tokens_per_update(cfg)
  assert set(smoke["runs"]) == {"zero1", "acco"}
  for method, seeds in smoke["runs"].items():
    run = seeds["0"]
    assert run["status"] == "ok", method
    assert math.isfinite(run["final_eval_loss"]) and 0 < run["final_eval_loss"] < 10
    # One training-loss point per update (ACCO's two stages are averaged), evals at every update.
    assert run["train"]["update"] == list(range(1, cfg["num_updates"] + 1)), method
    assert run["eval"]["update"] == list(range(1, cfg["num_updates"] + 1)), method
    assert _finite(run["train"]["loss"]) and _finite(run["eval"]["loss"])
    assert run["eval"]["tokens"][-1] == cfg["num_updates"] * convergence_settings.tokens_per_update(
      cfg
    )
    assert run["eval"]["loss"][-1] == pytest.approx(run["final_eval_loss"])
  summary = smoke["summary"]["methods"]
  assert summary["zero1"]["final_eval_loss"]["n"] == 1
  gap = summary["acco"]["gap_to_zero1"]["100%"]["abs"]["mean"]
  expected = (
    smoke["runs"]["acco"]["0"]["final_eval_loss"] - smoke["runs"]["zero1"]["0"]["final_eval_loss"]
  )
  assert gap == pytest.approx(expected)
  # Resumable: a second invocation finds both runs done and trains nothing.
  again = subprocess.run(
    [sys.executable, "-m", "bench.dp.convergence", "--smoke", "--out", str(tmp_path)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert again.returncode == 0 and "2 of 2 runs already done" in again.stderr


def _fake_run(root, setting, method, seed, evals, losses):
  d = convergence.run_dir(root, setting, method, seed)
  d.mkdir(parents=True)
  rows = []
  stages_per_update = 2 if method == "acco" else 1
  for i, loss in enumerate(losses):
    stage = i + 1
    update = stage // 2 if method == "acco" else stage
    rows.append({"step": stage, "stage": stage, "update": update, "loss": loss})
    if stage % stages_per_update == 0 and update in evals:
      rows.append({"step": stage, "update": update, "eval_loss": evals[update]})
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  result = {"method": method, "status": "ok", "final_eval_loss": evals[max(evals)], "wall_s": 1.0}
  (d / "result.json").write_text(json.dumps(result))


def test_collect_gaps_and_acco_stage_pairing(tmp_path, monkeypatch):
  setting = dict(
    convergence_settings.SETTINGS["smoke"], num_updates=4, eval_every=1, methods=("zero1", "acco")
  )
  monkeypatch.setitem(convergence_settings.SETTINGS, "fake", setting)
  for seed, (z, a) in enumerate([(2.0, 2.2), (4.0, 4.0)]):
    _fake_run(tmp_path, "fake", "zero1", seed, {u: z + 4 - u for u in (1, 2, 3, 4)}, [5, 4, 3, 2])
    acco_losses = [6, 4, 5, 3, 4, 2, 3, 1]  # two stages per update: means 5, 4, 3, 2
    _fake_run(tmp_path, "fake", "acco", seed, {u: a + 4 - u for u in (1, 2, 3, 4)}, acco_losses)
  res = convergence.collect(tmp_path, ["fake"], [0, 1], wall_s=None)
  runs = res["settings"]["fake"]["runs"]
  assert runs["acco"]["0"]["train"]["update"] == [1, 2, 3, 4]
  assert runs["acco"]["0"]["train"]["loss"] == [5, 4, 3, 2]
  summary = res["settings"]["fake"]["summary"]
  assert summary["points"] == {"25%": 1, "50%": 2, "100%": 4}
  acco = summary["methods"]["acco"]
  assert acco["final_eval_loss"]["mean"] == pytest.approx(3.1)  # (2.2 + 4.0) / 2
  g = acco["gap_to_zero1"]["100%"]
  assert g["abs"]["values"] == pytest.approx([0.2, 0.0])
  assert g["rel_pct"]["mean"] == pytest.approx(5.0)  # (10% + 0%) / 2
  assert acco["gap_to_zero1"]["25%"]["abs"]["values"] == pytest.approx([0.2, 0.0])


def test_dpu_warmup_scaling():
  assert convergence_settings.warmup_updates("dpu", 160) == 0
  assert convergence_settings.warmup_updates("dpu-w40", 160) == 3
  assert convergence_settings.warmup_updates("dpu-w500", 160) == 40
  assert convergence_settings.warmup_updates("dpu-w40", 10) == 1  # never rounds a warm-up away


def test_quadratic_theory_and_small_sweep(tmp_path):
  # Theory: ACCO's radius is max(|1 - h|, h/2) (GD's up to h = 2/3), DPU's sqrt(h) past h = 1/4.
  assert quadratic.stability_limit("sgd") == pytest.approx(2.0, abs=1e-6)
  assert quadratic.stability_limit("acco") == pytest.approx(2.0, abs=1e-6)
  assert quadratic.stability_limit("dpu") == pytest.approx(1.0, abs=1e-6)
  for h in (0.1, 0.5, 0.9, 1.5):
    assert quadratic.spectral_radius("acco", h) == pytest.approx(max(abs(1 - h), h / 2))
    for m in quadratic.METHODS:
      assert quadratic.measured_rate(m, h) == pytest.approx(
        quadratic.spectral_radius(m, h), rel=2e-2
      ), (m, h)
    # From θ̃_0 = θ_0, noise-free ACCO is exactly gradient descent.
    assert quadratic.measured_rate("acco", h, generic=False) == pytest.approx(abs(1 - h), abs=1e-3)

  out = tmp_path / "q.json"
  assert quadratic.main(["--small", "--out", str(out)]) == 0
  res = json.loads(out.read_text())
  rows = {m: {r["eta_l"]: r for r in res["noisy"]["methods"][m]} for m in quadratic.METHODS}
  # Small step: ACCO (two half-batches) matches SGD with the same batch per update.
  assert rows["acco"][0.1]["final_mean"] == pytest.approx(rows["sgd"][0.1]["final_mean"], rel=0.05)
  # Large step (ηL = 1.5, beyond DPU's limit of 1): ACCO converges, DPU diverges.
  assert math.isfinite(rows["acco"][1.5]["final_mean"])
  assert rows["acco"][1.5]["diverged_seeds"] == 0
  assert rows["dpu"][1.5]["diverged_seeds"] == res["setup"]["seeds"]
  assert rows["acco"][1.5]["final_mean"] < rows["dpu"][1.5]["final_mean"]
