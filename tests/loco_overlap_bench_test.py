"""bench/loco/loco_overlap.py: every run of its grid is a config the trainer accepts, in the full setting
and in ``--smoke`` (Streaming DiLoCo's phase mode needs ``loco.overlap_steps=0``), and its table
pairs each mode with ``none`` seed by seed."""

import pytest

from acco_jax.loco import build
from bench.loco import (
  loco_compare,  # noqa: E402
  loco_overlap,  # noqa: E402
)


@pytest.mark.parametrize("smoke", [False, True], ids=["full", "smoke"])
@pytest.mark.parametrize("mode", loco_overlap.MODES)
@pytest.mark.parametrize("case", list(loco_overlap.CASES))
def test_every_run_is_a_valid_config(case, mode, smoke):
  updates = None if smoke else 200
  config = loco_compare.make_config(loco_overlap.label(case, mode, updates), 0, smoke)
  method = build._check_loco(config)  # the trainer's one-line refusals
  assert method.outer_overlap == mode == config.loco.outer_overlap
  assert config.loco.overlap_steps == 0
  assert config.train.num_updates == (loco_compare.SMOKE["num_updates"] if smoke else 200)
  if not smoke:
    assert config.loco.sync_every == int(case.split()[1].partition("=")[2])


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
  """bench/dp/perfmodel.py --loco: eager DiLoCo stops hiding its sync at the bandwidth where the
  sync's time (hops x latency + bytes / bandwidth) equals H inner steps; blocking DiLoCo never
  hides it; Streaming DiLoCo's fragment hides behind H/P steps."""
  import json

  from bench.dp import perfmodel

  programs = json.loads((loco_compare.common.RESULTS / "loco_compare.json").read_text())["programs"]
  label = "diloco H=15 eager / delayed"
  prog = perfmodel.loco_program(programs, "diloco", 15, 0)
  inner = perfmodel.loco_point(label, prog, 1e4)["inner_s"]
  a = loco_compare.PROJECTION
  sync_bytes = prog["accounting"]["sync_wire"]["0"] * a["params"] / prog["params"]
  hops = 2 * (a["workers"] - 1) * a["latency_inter_s"]
  expected = sync_bytes / (15 * inner - hops) / (perfmodel.pm.GBIT * a["link_efficiency"])
  assert perfmodel.loco_below(label, prog, 0.0) == pytest.approx(expected, rel=1e-6)
  assert perfmodel.loco_point(label, prog, 1.01 * expected)["exposed_s"] == 0
  assert perfmodel.loco_point(label, prog, 0.99 * expected)["exposed_s"] > 0
  assert perfmodel.loco_below("diloco H=15 none", prog, 0.0) == float("inf")
  streaming = perfmodel.loco_program(programs, "streaming_diloco", 50, 0)
  slow = perfmodel.loco_point("streaming_diloco H=50 P=2 eager / delayed", streaming, 0.1)
  wires = streaming["accounting"]["sync_wire"].values()
  per_link = 0.1 * perfmodel.pm.GBIT * a["link_efficiency"]
  hidden = sum(
    max(0, hops + w * a["params"] / prog["params"] / per_link - 25 * inner) for w in wires
  )
  assert slow["exposed_s"] == pytest.approx(hidden / 50)
