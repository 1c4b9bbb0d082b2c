"""Smoke tests of bench.dp.memory, bench.dp.overhead, bench.dp.memory_muon and bench.dp.muon: tiny
models, a few steps, JSON checked.

The benchmarks run as subprocesses (they start their own JAX processes with their own device
counts), writing JSON to a temporary directory. memory and overhead run concurrently and are slow, as is memory_muon;
muon's smoke (two 2-update runs of the tiny model, Muon under zero1 and acco; 24 s on a quiet
2-core machine, about 60 CPU-seconds, mostly compiling) is slow too; its collection (tuning
choice, paired differences, the tokens_seen check) is tested in the default run on synthetic run
directories.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("bench")
  procs = {}
  for name in ("memory", "overhead"):
    cmd = [
      sys.executable,
      "-m",
      f"bench.dp.{name}",
      "--smoke",
      "--out",
      str(tmp / name),
    ]
    procs[name] = subprocess.Popen(
      cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
  out = {}
  for name, proc in procs.items():
    try:
      log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
      proc.kill()
      log, _ = proc.communicate()
      pytest.fail(f"bench.dp.{name} --smoke timed out after {TIMEOUT_S} s:\n{log[-3000:]}")
    assert proc.returncode == 0, f"bench.dp.{name} --smoke failed:\n{log[-3000:]}"
    out[name] = (json.loads((tmp / name).read_text()), log)
  return out


@pytest.mark.slow
def test_memory_smoke(results):
  data, log = results["memory"]
  assert data["benchmark"] == "memory"
  assert data["failures"] == []
  assert {"cpu", "jax", "date"} <= set(data["machine"])
  assert "state/paper" in data["table"] and "state/paper" in log
  rows = {(r["method"], r["N"]): r for r in data["rows"]}
  assert set(rows) == {(m, n) for m in ("zero1", "acco") for n in (2, 4)}
  for (method, n), r in rows.items():
    psi = r["psi"]
    assert psi > 10_000
    # The state bytes from shard shapes are exactly what XLA passes as arguments (minus the batch).
    assert r["state_bytes"] == r["argument_minus_inputs"], (method, n)
    # ...and match this layout's formula up to the per-leaf padding to a multiple of N.
    assert 1.0 <= r["ratio_to_layout"] < 1.02, (method, n, r["ratio_to_layout"])
    assert r["ratio_to_paper"] == pytest.approx(
      r["state_bytes"] / (r["paper_formula_per_param"] * psi)
    )
    comp = r["state_components"]
    assert comp["w"] == pytest.approx(2 * psi, rel=0.02)
    assert comp["opt"] == pytest.approx(8 * psi / n, rel=0.02)
    mem = r["compiled"]
    assert mem["temp"] > 0 and mem["argument"] > r["state_bytes"]
    assert mem["alias"] >= r["state_bytes"] - 8  # the donated state is aliased to the output
    cats = r["temp_breakdown"]["bytes_by_category"]
    assert 0 < sum(cats.values()) <= mem["temp"]
    assert r["compile_s"] > 0
  for n in (2, 4):
    acco, zero1 = rows[("acco", n)], rows[("zero1", n)]
    psi = acco["psi"]
    extra = acco["state_bytes"] - zero1["state_bytes"]
    # ACCO adds the bf16 gradient buffer (2Ψ) and the committed fp32 master shard (4Ψ/N).
    assert extra == pytest.approx((2 + 4 / n) * psi, rel=0.02), (n, extra / psi)
    assert acco["state_components"]["buf"] == pytest.approx(2 * psi, rel=0.02)
    assert zero1["state_components"]["buf"] == 0
  # Sharded state shrinks with N; the replicated weights and buffer do not.
  assert rows[("zero1", 4)]["state_bytes"] < rows[("zero1", 2)]["state_bytes"]


@pytest.mark.slow
def test_overhead_smoke(results):
  data, log = results["overhead"]
  assert data["benchmark"] == "overhead"
  assert "acco/plain" in log
  cfg = data["config"]
  assert data["tokens_per_step"] == cfg["microbatches"] * cfg["rows"] * data["model"]["L"]
  res = data["results"]
  assert set(res) == {"plain", "acco"}
  for name, r in res.items():
    assert len(r["step_s"]) == cfg["rounds"], name
    assert all(t > 0 for t in r["step_s"])
    assert r["tokens_per_s"] == pytest.approx(data["tokens_per_step"] / r["median_step_s"])
    assert r["ratio_to_plain"] > 0 and r["ratio_to_plain_paired_median"] > 0
    assert r["static"]["temp_bytes"] > 0
  assert res["plain"]["ratio_to_plain"] == pytest.approx(1.0)
  assert data["acco_ratio"] == pytest.approx(res["acco"]["ratio_to_plain"])
  assert isinstance(data["target_holds"], bool)
  assert isinstance(data["target_holds_cpu_time"], bool)


@pytest.mark.slow
def test_memory_muon_smoke(tmp_path):
  """python -m bench.dp.memory_muon --smoke: the owner layout shards Muon's state, at the price of its padding."""
  out = tmp_path / "memory_muon.json"
  cmd = [
    sys.executable,
    "-m",
    "bench.dp.memory_muon",
    "--smoke",
    "--out",
    str(out),
  ]
  proc = subprocess.run(
    cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S
  )
  assert proc.returncode == 0, proc.stdout[-3000:]
  data = json.loads(out.read_text())
  assert data["failures"] == [] and "opt/(ddp/N)" in data["table"]
  rows = {(r["method"], r["opt"]): r for r in data["rows"]}
  assert set(rows) == {(m, o) for m in ("ddp", "zero1", "acco") for o in ("adamw", "muon")}
  layouts = {k: r["layout"] for k, r in rows.items()}
  assert layouts == {
    k: "owner" if k[1] == "muon" and k[0] != "ddp" else "tree" if k == ("ddp", "muon") else "flat"
    for k in rows
  }
  opt = lambda m, o: rows[(m, o)]["state_components"]["opt"]
  owner, n = rows[("zero1", "muon")], rows[("zero1", "muon")]["N"]
  assert n == 8
  # Sharded by owners: below DDP's whole state, above its 1/N share by at most the padding (Muon's
  # fp32 momentum on empty slots, Adam's m, v on the elementwise part's padding) and a few scalars.
  flat_pad = owner["padding"] - owner["slot_padding"]
  ideal = opt("ddp", "muon") / n
  assert ideal < opt("zero1", "muon") < opt("ddp", "muon")
  assert opt("zero1", "muon") <= ideal + (4 * owner["slot_padding"] + 8 * flat_pad) / n + 1024
  assert 0 <= opt("acco", "muon") - opt("zero1", "muon") <= 64  # ACCO's own counters
  assert opt("zero1", "adamw") == pytest.approx(opt("ddp", "adamw") / n, rel=0.02)
  # Owners balanced within one largest matrix; the loads are exactly the owned fp32 matrices.
  loads = owner["loads"]
  assert max(loads) - min(loads) <= owner["largest_item_bytes"]
  assert sum(loads) == 4 * owner["owned_elements"]
  assert owner["slot_padding"] == n * owner["slot_size"] - owner["owned_elements"] > 0
  # The wire carries the owner's longer row: 2 (N - 1) R bf16 values per stage, twice for ACCO.
  flat = rows[("zero1", "adamw")]
  assert owner["row"] > flat["row"] and owner["padded_size"] == n * owner["row"]
  assert owner["wire_bytes_per_update"] == 2 * (n - 1) * owner["row"] * 2
  assert rows[("acco", "muon")]["wire_bytes_per_update"] == 2 * owner["wire_bytes_per_update"]
  # ACCO's committed master is the master's size; the bf16 buffer is the padded row length.
  acco = rows[("acco", "muon")]["state_components"]
  assert acco["committed"] == acco["master"] == owner["state_components"]["master"]
  assert acco["buf"] >= 2 * owner["padded_size"]


@pytest.mark.slow
def test_muon_smoke(tmp_path):
  """python -m bench.dp.muon --smoke: Muon under zero1 and acco, finite losses, the same tokens_seen."""
  cmd = [sys.executable, "-m", "bench.dp.muon", "--smoke", "--out", str(tmp_path)]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
  assert proc.returncode == 0, proc.stderr[-3000:]
  data = json.loads((tmp_path / "muon_smoke.json").read_text())
  assert set(data["runs"]) == {"zero1/muon", "acco/muon"}
  assert data["chosen"] == {"adamw_lr": 2e-3, "muon_lr": 0.02, "muon_adamw_lr": 2e-3}
  updates = data["setting"]["num_updates"]
  tokens = set()
  for key, by_seed in data["runs"].items():
    run = by_seed["0"]
    assert run["status"] == "ok", key
    assert math.isfinite(run["final_eval_loss"]) and math.isfinite(run["final_train_loss"]), key
    assert run["updates"] == updates, key
    # one training-loss point per update of tokens (acco's two half-batch stages are one update)
    assert run["train"]["update"] == list(range(1, updates + 1)), key
    assert all(math.isfinite(x) for x in run["train"]["loss"] + run["eval"]["loss"]), key
    assert run["tokens_seen"] == updates * run["tokens_per_update"], key
    tokens.add(run["tokens_seen"])
  assert len(tokens) == 1 and data["tokens_equal"]
  assert data["runs"]["acco/muon"]["0"]["stages"] == 2 * data["runs"]["zero1/muon"]["0"]["stages"]
  for key in data["runs"]:
    assert data["summary"][key]["final_eval_loss"]["n"] == 1
  assert "zero1 | muon" in (tmp_path / "muon_smoke.md").read_text()


def _fake_run(out, method, opt, lr, muon_lr, seed, loss, updates=4, tokens_per_stage=None):
  """A run directory as bench/dp/muon.py's worker leaves it: result.json and metrics.jsonl (ACCO: two
  stages of half a batch per update)."""
  from bench.dp import muon

  d = muon.run_dir(out, "cpu", updates, method, opt, lr, muon_lr, seed)
  d.mkdir(parents=True)
  config = {
    "mesh": {"num_devices": 8},
    "batch": {"microbatches": 4, "microbatch_size": 2},
    "data": {"seq_len": 128},
  }
  result = {"status": "ok", "final_eval_loss": loss, "wall_s": 1.0, "config": config}
  (d / "result.json").write_text(json.dumps(result))
  per = 2 if method == "acco" else 1
  step = tokens_per_stage or 8 * 4 * 2 * 128 // per
  rows = [
    {"stage": s, "update": s // per, "loss": loss + 1 / s, "tokens_seen": s * step}
    for s in range(1, updates * per + 1)
  ]
  rows.append({"update": updates, "eval_loss": loss})
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_muon_collect_synthetic(tmp_path):
  """bench/dp/muon.py's tuning choice, grouping per update, paired differences and token check."""
  from bench.dp import muon

  sweep = [("zero1", "muon", 2e-3, m, 0) for m in (0.02, 0.04, 0.08)]
  for r, loss in zip(sweep, (5.0, 4.8, float("nan")), strict=True):
    _fake_run(tmp_path, *r, loss)
  won, rows = muon.best(tmp_path, "cpu", 4, sweep)
  assert won["muon_lr"] == 0.04 and len(rows) == 3  # the NaN run is not chosen
  for seed in (0, 1):
    for method in ("zero1", "acco"):
      _fake_run(tmp_path, method, "adamw", 1e-3, 0.04, seed, 5.0 + seed)
      if not (seed == 0 and method == "zero1"):  # zero1/muon seed 0: the tuning run
        _fake_run(tmp_path, method, "muon", 2e-3, 0.04, seed, 4.5 + seed)
  res = muon.collect(tmp_path, "cpu", 4, [0, 1], 1e-3, 0.04, 2e-3, {})
  assert res["tokens_equal"] and set(res["tokens_seen"].values()) == {4 * 8192}
  acco = res["runs"]["acco/adamw"]["0"]
  assert acco["train"]["update"] == [1, 2, 3, 4] and acco["stages"] == 8 and acco["updates"] == 4
  assert res["summary"]["zero1/muon"]["final_eval_loss"]["values"] == [4.8, 5.5]
  c = res["comparisons"]["acco: muon vs adamw"]["per_seed_pct"]
  assert c == pytest.approx([100 * (4.5 / 5.0 - 1), 100 * (5.5 / 6.0 - 1)])
  assert "| acco | muon |" in muon.table(res)
  # a run that saw other tokens (a shorter ACCO stage) is caught
  _fake_run(tmp_path, "acco", "adamw", 1e-3, 0.04, 2, 5.0, tokens_per_stage=1000)
  assert not muon.collect(tmp_path, "cpu", 4, [0, 1, 2], 1e-3, 0.04, 2e-3, {})["tokens_equal"]
