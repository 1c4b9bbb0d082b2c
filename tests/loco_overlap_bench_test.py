"""bench.loco.loco_overlap: every run of its grid is a config the trainer accepts, in the full setting
and in ``--smoke`` (Streaming DiLoCo's phase mode needs ``loco.overlap_steps=0``), and its table
pairs each mode with ``none`` seed by seed."""

import pytest

from acco_jax.loco import build
from bench.loco import (
  loco_compare,  # noqa: E402
  loco_overlap,  # noqa: E402
)

GRID_RUNS = [
  (grid, case, mode)
  for grid in loco_overlap.GRIDS
  for case, mode, _ in loco_overlap.plan_labels(
    grid, list(loco_overlap.GRIDS[grid]), loco_overlap.MODES, None
  )
]


@pytest.mark.parametrize("smoke", [False, True], ids=["full", "smoke"])
@pytest.mark.parametrize("grid,case,mode", GRID_RUNS)
def test_every_run_is_a_valid_config(grid, case, mode, smoke):
  updates = None if smoke or grid == "long" else 200
  name = "smoke" if smoke else grid
  config = loco_compare.make_config(loco_overlap.label(case, mode, updates, grid), 0, name)
  expected = loco_compare.setting(name)["num_updates"] if updates is None else updates
  assert config.train.num_updates == expected
  if len(loco_overlap.GRIDS[grid][case][1]) == 1:  # a reference: its method as it is
    assert "loco.outer_overlap" not in loco_overlap.label(case, mode, None, grid)
    if case != "ddp":
      assert build._check_loco(config).outer_overlap == "none"
    return
  method = build._check_loco(config)  # the trainer's one-line refusals
  assert method.outer_overlap == mode == config.loco.outer_overlap
  assert config.loco.overlap_steps == 0
  if not smoke:
    assert config.loco.sync_every == int(case.split()[1].partition("=")[2])


def test_the_long_setting_has_the_syncs_it_promises():
  """Issue 49: at least 60 syncs at H = 30, 20 at H = 100, and an evaluation every 50 steps."""
  s = loco_compare.setting("long")
  assert s["num_updates"] // 30 >= 60 and s["num_updates"] // 100 >= 20
  assert s["num_updates"] // s["eval_every"] >= 40
  assert loco_compare.run_dir(loco_compare.common.RESULTS, "ddp", 1, "long").parts[-4:] == (
    "runs",
    "loco_long",
    "ddp",
    "seed1",
  )


def test_the_table_pairs_each_mode_with_none_by_seed():
  def run(loss):
    return {"final_eval_loss": loss}

  loss = {"none": [4.0, 5.0], "delayed": [4.4, 5.5], "eager": [4.0, 4.5]}
  case = next(iter(loco_overlap.CASES))
  summary = {case: {}}
  for mode, values in loss.items():
    finals = dict(enumerate(values))
    summary[case][mode] = {
      "final_eval_loss": loco_compare.convergence._mean_std(list(finals.values())),
      "vs_none_pct": [100 * (finals[k] / loss["none"][k] - 1) for k in finals],
    }
    summary[case][mode]["vs_none_pct_mean"] = sum(summary[case][mode]["vs_none_pct"]) / 2
  text = loco_overlap.table({"summary": summary})
  row = text.splitlines()[2]
  assert row.startswith(f"| {case} | 4.500 ± 0.707 (2) | 4.950 ± 0.778 (2) |")
  assert "+10.0% (+10.0, +10.0)" in row and "-5.0% (+0.0, -10.0)" in row


def test_the_modelled_threshold_is_where_a_sync_outlasts_its_phase():
  """python -m bench.dp.perfmodel --loco: eager DiLoCo stops hiding its sync at the bandwidth where the
  sync's time (hops x latency + bytes / bandwidth) equals H inner steps; blocking DiLoCo never
  hides it; Streaming DiLoCo's fragment hides behind H/P steps."""
  import json

  from acco_jax.analysis import perfmodel as pm
  from bench.dp import perfmodel_loco
  from bench.loco import traffic_cost

  programs = json.loads((loco_compare.common.RESULTS / "loco_compare.json").read_text())["programs"]
  label = "diloco H=15 eager / delayed"
  prog = perfmodel_loco.loco_program(programs, "diloco", 15, 0)
  inner = perfmodel_loco.loco_point(label, prog, 1e4)["inner_s"]
  a = traffic_cost.PROJECTION
  sync_bytes = prog["accounting"]["sync_wire"]["0"] * a["params"] / prog["params"]
  hops = 2 * (a["workers"] - 1) * a["latency_inter_s"]
  expected = sync_bytes / (15 * inner - hops) / (pm.GBIT * a["link_efficiency"])
  assert perfmodel_loco.loco_below(label, prog, 0.0) == pytest.approx(expected, rel=1e-6)
  assert perfmodel_loco.loco_point(label, prog, 1.01 * expected)["exposed_s"] == 0
  assert perfmodel_loco.loco_point(label, prog, 0.99 * expected)["exposed_s"] > 0
  assert perfmodel_loco.loco_below("diloco H=15 none", prog, 0.0) == float("inf")
  streaming = perfmodel_loco.loco_program(programs, "streaming_diloco", 50, 0)
  slow = perfmodel_loco.loco_point("streaming_diloco H=50 P=2 eager / delayed", streaming, 0.1)
  wires = streaming["accounting"]["sync_wire"].values()
  per_link = 0.1 * pm.GBIT * a["link_efficiency"]
  hidden = sum(
    max(0, hops + w * a["params"] / prog["params"] / per_link - 25 * inner) for w in wires
  )
  assert slow["exposed_s"] == pytest.approx(hidden / 50)


def _fake_run(d, method, evals: dict, baseline=3.0):
  """A run directory as loco_compare's worker leaves it: metrics.jsonl and result.json."""
  import json

  d.mkdir(parents=True)
  rows = [{"stage": u, "update": u, "loss": loss + 0.1} for u, loss in evals.items()]
  rows += [{"update": u, "eval_loss": loss} for u, loss in evals.items()]
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  result = {
    "method": method,
    "status": "ok",
    "wall_s": 1.0,
    "summary": {"unigram_baseline": baseline},
  }
  result["final_eval_loss"] = evals[max(evals)]
  (d / "result.json").write_text(json.dumps(result))


def test_the_long_grid_pairs_with_blocking_diloco_and_ddp_and_follows_the_gap(tmp_path):
  """collect on synthetic runs: the paired differences to the references, and the gap to the
  blocking run at each evaluation with the syncs done by then (H = 30), computed by hand here."""
  evals = {  # (case, mode) -> seed -> {update: eval loss}
    ("diloco H=30", "none"): {0: {60: 3.0, 120: 2.5}, 1: {60: 3.2, 120: 2.4}},
    ("diloco H=30", "eager"): {0: {60: 3.3, 120: 2.6}, 1: {60: 3.6, 120: 2.52}},
    ("ddp", "none"): {0: {60: 2.9, 120: 2.0}, 1: {60: 3.0, 120: 2.4}},
  }
  for (case, mode), by_seed in evals.items():
    text = loco_overlap.label(case, mode, None, "long")
    for seed, curve in by_seed.items():
      _fake_run(loco_compare.run_dir(tmp_path, text, seed, "long"), case.split()[0], curve)
  res = loco_overlap.collect(tmp_path, [0, 1], None, "long", "long")
  assert res["unigram_baseline"] == 3.0 and set(res["runs"]) == {"diloco H=30", "ddp"}
  eager = res["summary"]["diloco H=30"]["eager"]
  assert eager["vs_none_pct"] == pytest.approx([4.0, 5.0])  # 2.6 / 2.5, 2.52 / 2.4
  assert eager["vs_blocking_pct"] == pytest.approx([4.0, 5.0])
  assert eager["vs_ddp_pct"] == pytest.approx([30.0, 5.0])  # 2.6 / 2.0, 2.52 / 2.4
  assert eager["vs_ddp_pct_mean"] == pytest.approx(17.5)
  assert res["summary"]["ddp"]["none"]["vs_blocking_pct"] == pytest.approx([-20.0, 0.0])
  gap = eager["gap"]
  assert gap["update"] == [60, 120] and gap["syncs"] == [2, 4]
  assert gap["pct"] == pytest.approx([(10.0 + 12.5) / 2, 4.5])
  assert "gap" not in res["summary"]["diloco H=30"]["none"]
  text = loco_overlap.long_table(res)
  assert "| diloco H=30 | eager | 2.560 ± 0.057 (2.600, 2.520) | +4.5% (+4.0, +5.0) |" in text
  assert "| diloco H=30 eager | " in text and "| +4.5% (step 120, 4 syncs) |" in text


@pytest.mark.slow
def test_the_long_grid_driver_runs_at_tiny_length(tmp_path):
  """python -m bench.loco.loco_overlap --setting long --smoke: three runs of the long grid (4 steps of the
  tiny model), their JSON, tables and figures."""
  import json
  import subprocess
  import sys

  cmd = [
    sys.executable,
    "-m",
    "bench.loco.loco_overlap",
    "--setting",
    "long",
    "--smoke",
    "--out",
    str(tmp_path),
    "--jobs",
    "2",
    "--cases",
    "diloco H=30",
    "ddp",
    "--modes",
    "none",
    "eager",
  ]
  proc = subprocess.run(
    cmd, cwd=loco_compare.common.REPO, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  res = json.loads((tmp_path / "loco_long_smoke.json").read_text())
  assert res["grid"] == "long" and res["updates"] == loco_compare.SMOKE["num_updates"]
  assert {(c, m) for c, by in res["runs"].items() for m in by} == {
    ("diloco H=30", "none"),
    ("diloco H=30", "eager"),
    ("ddp", "none"),
  }
  for by_mode in res["runs"].values():
    for by_seed in by_mode.values():
      assert [r["status"] for r in by_seed.values()] == ["ok"]
  eager = res["summary"]["diloco H=30"]["eager"]
  assert len(eager["vs_ddp_pct"]) == 1 and eager["gap"]["update"]
  for name in ("diloco_h30", "references", "gap"):
    assert (tmp_path / f"loco_long_{name}.png").stat().st_size > 1000
  assert not (tmp_path / "loco_long_diloco_h100.png").exists()  # not in this subset
  assert "vs DDP" in (tmp_path / "loco_long_smoke.md").read_text()
