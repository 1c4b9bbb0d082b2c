r"""Every method on one problem: hiding communication (ACCO) against reducing it (the LoCo family).

ddp, zero1, acco, diloco, streaming diloco, noloco, sparseloco and demo train the CPU-scale model and
data of ``bench/dp/convergence.py`` (its ``d8`` setting: D=128, 2 layers, 2k BPE on the embedded
corpus, context 64, AdamW at a constant 2e-3 without clipping) with **equal tokens**: 2048 tokens per
step, 8 devices. The data-parallel methods (ddp, zero1, acco) run on all 8 devices; the
low-communication methods run ``M = 8`` workers of one device each, which see the same 2048 tokens
per inner step (256 each). ``H = 50`` for DiLoCo, Streaming DiLoCo (2 fragments, ``τ = 1``,
``α = 0.5``, FP4), NoLoCo and SparseLoCo (1.56%, 2-bit); DeMo updates every step. Each run is a
``train.py``-equivalent process (:func:`acco_jax.run.trainer.train_and_evaluate`) writing
``<out>/runs/loco_compare/<method>/seed<k>/`` (resumable: a run with a ``result.json`` is skipped).

Reported, per method (mean ± std over seeds):

* the final eval loss, and the eval curves (``docs/figures/loco_compare.png``);
* bytes sent per worker per token and per sync, **read from the compiled programs**, beside the
  packed bytes of the accounting, and the optimizer and communication state per device
  (:mod:`bench.loco.traffic_cost`: ring algorithms; XLA:CPU computes bf16 collectives and the emulated
  FP4 in f32, so for those the HLO shows f32 and the accounting the bytes as sent);
* the modelled time to reach a target eval loss with 8 x H100 per worker and 1, 10 or 100 Gbit/s
  between workers (:func:`bench.loco.traffic_cost.project`; the assumptions in its ``PROJECTION``).

Usage::

  python -m bench.loco.loco_compare --jobs 2              # 8 methods x 3 seeds, then collect
  python -m bench.loco.loco_compare --collect             # rebuild the JSON, table and figure only
  python -m bench.loco.loco_compare --smoke --out /tmp/lc # CI-size: tiny model, 2 steps
  python -m bench.loco.loco_compare --setting long --methods ddp   # LONG: 2,000 byte-level steps
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import common
from bench.dp import convergence
from bench.loco.traffic_cost import programs_worker, project

FIGURES = common.REPO / "docs" / "figures"

SETTING = dict(
  devices=8,
  workers=8,
  D=128,
  N=2,
  H=4,
  tokenizer="bpe:2048",
  seq_len=64,
  microbatch_size=1,
  microbatches=4,
  num_updates=400,
  eval_every=25,
  eval_batches=12,
  lr=2e-3,
)
# SETTING's, but:
SMOKE = {
  **SETTING,
  **dict(D=32, H=2, tokenizer="byte", seq_len=32, microbatches=2, num_updates=4),
  **dict(eval_every=2, eval_batches=2),
}
# the long runs (loco_overlap.py --setting long): 2,000 steps of a byte-level model, 66 syncs at H = 30
LONG = {  # SETTING's, but:
  **SETTING,
  **dict(D=64, tokenizer="byte", microbatches=2, num_updates=2000, eval_every=50, eval_batches=4),
}
SETTINGS = {"d8": SETTING, "long": LONG, "smoke": SMOKE}
SYNC_EVERY = 50
DEMO_LR = 1e-3  # DeMo's sign step (constant, like the others' AdamW lr)
# label -> (config module, overrides of the method's own config)
METHODS = {
  "ddp": ("gpt2_ddp", {}),
  "zero1": ("gpt2_zero1", {}),
  "acco": ("gpt2_acco", {}),
  "diloco": ("gpt2_diloco", {"loco.sync_every": SYNC_EVERY}),
  "streaming_diloco": ("gpt2_streaming_diloco", {"loco.sync_every": SYNC_EVERY}),
  "noloco": ("gpt2_noloco", {"loco.sync_every": SYNC_EVERY}),
  "sparseloco": ("gpt2_sparseloco", {"loco.sync_every": SYNC_EVERY}),
  "demo": ("gpt2_demo", {"opt.lr": DEMO_LR}),
}
LOCO = ("diloco", "streaming_diloco", "noloco", "sparseloco", "demo")
SEEDS = (0, 1, 2)
# simulated devices wait up to 15 minutes in a collective (common.cpu_env); warn after 5, not 20 s
QUIET_COLLECTIVES = "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300"
GBITS = (1.0, 10.0, 100.0)


def setting(name: str = "d8") -> dict:
  """The run setting ``name``: ``d8`` (the comparison's), ``long`` or ``smoke`` (CI-size)."""
  return SETTINGS[name]


def tokens_per_update(s: dict) -> int:
  return s["devices"] * s["microbatches"] * s["microbatch_size"] * s["seq_len"]


# -- one run (child process) ------------------------------------------------------------------------


_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def parse_label(label: str) -> tuple[str, dict]:
  """``method[@sweep]`` -> (method, config overrides). A sweep is a learning rate (``demo@2e-3``)
  or ``group.field=value`` pairs joined by ``,`` (``sparseloco@loco.sync_every=15,loco.topk=128``);
  each value is read as the type the config gives its field."""
  base, _, sweep = label.partition("@")
  if base not in METHODS:
    raise SystemExit(
      f"loco_compare: unknown method {base!r} in {label!r}; use one of {list(METHODS)}"
    )
  if not sweep:
    return base, {}
  if "=" not in sweep:
    try:
      return base, {"opt.lr": float(sweep)}
    except ValueError:
      raise SystemExit(
        f"loco_compare: bad sweep {sweep!r} in {label!r}; write a learning rate or group.field=value"
      ) from None
  overrides = {}
  for item in sweep.split(","):
    key, eq, text = item.partition("=")
    if not eq or key.count(".") != 1:
      raise SystemExit(f"loco_compare: bad sweep {item!r} in {label!r}; write group.field=value")
    overrides[key] = text  # read as the field's type by make_config
  return base, overrides


def make_config(label: str, seed: int, name: str = "d8"):
  """The trainer config: the method's config file, shrunk to setting ``name`` (d8: convergence.py's)."""
  import importlib

  base, sweep = parse_label(label)
  module, overrides = METHODS[base]
  overrides = {**overrides, **sweep}
  s = setting(name)
  c = importlib.import_module(f"configs.{module}").get_config("cpu")
  c.model.D, c.model.N, c.model.H = s["D"], s["N"], s["H"]
  c.data.tokenizer, c.data.seq_len = s["tokenizer"], s["seq_len"]
  c.batch.microbatch_size, c.batch.microbatches = s["microbatch_size"], s["microbatches"]
  c.opt.lr, c.opt.schedule, c.opt.warmup_updates, c.opt.min_lr_ratio = s["lr"], "constant", 0, 1.0
  c.opt.weight_decay, c.opt.decay, c.opt.clip_norm = 0.1, "all", 0.0  # the same inner AdamW
  c.train.num_updates, c.train.seed = s["num_updates"], seed
  c.train.log_every = 5
  c.train.eval_every, c.train.eval_batches = s["eval_every"], s["eval_batches"]
  c.train.sample_tokens = 0
  c.ckpt.every, c.ckpt.async_save = 0, False
  c.mesh.num_devices, c.mesh.cpu_devices = s["devices"], 0
  if base in LOCO:
    c.loco.workers = s["workers"]
  if base == "demo":
    c.opt.weight_decay = 0.0  # the reference's DeMo (decoupled, on the sign step)
  for key, value in overrides.items():
    group, field = key.split(".")
    if group not in c or field not in c[group]:
      raise SystemExit(f"loco_compare: {label!r} sets {key}, which the config does not have")
    kind = type(c[group][field])
    if isinstance(value, str) and kind is not str:
      try:
        value = _BOOLS[value.lower()] if kind is bool else kind(value)
      except (KeyError, ValueError):
        raise SystemExit(f"loco_compare: {label!r}: {key} takes {kind.__name__} values") from None
    c[group][field] = value
  if name == "smoke" and base in LOCO and base != "demo":
    c.loco.sync_every = 2 * c.loco.fragments  # a fragment every 2 steps: tau = 1 fits in H/P
  return c


def train_worker(args) -> None:
  config = make_config(args.method, args.seed, args.setting)
  result = {"method": args.method, "seed": args.seed}
  common.train_run(config, args.workdir, result, time.perf_counter())


# -- the driver ---------------------------------------------------------------------------------------


def run_dir(out: Path, label: str, seed: int, name: str = "d8") -> Path:
  """``<out>/runs/loco_compare/<label>/seed<k>`` (the long setting's runs: ``runs/loco_long``)."""
  family = "loco_long" if name == "long" else "loco_compare"
  return out / "runs" / family / label / f"seed{seed}"


def launch(out: Path, label: str, seed: int, name: str) -> subprocess.Popen:
  d = run_dir(out, label, seed, name)
  if d.exists():
    shutil.rmtree(d)
  d.mkdir(parents=True)
  cmd = [
    *common.module_command(__spec__.name),
    "--train-worker",
    "--workdir",
    str(d),
    "--method",
    label,
    "--seed",
    str(seed),
    "--setting",
    name,
  ]
  log = open(d / "run.log", "w")
  env = common.cpu_env(setting(name)["devices"])
  env["XLA_FLAGS"] += " " + QUIET_COLLECTIVES
  proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=common.REPO)
  proc.log = log
  return proc


def run_all(out: Path, plan: list, jobs: int, timeout_s: float, name: str) -> list[str]:
  """Runs the missing ``(label, seed)`` runs of ``plan`` in setting ``name`` with convergence.py's
  scheduler."""
  start = lambda o, label, seed: launch(o, label, seed, name)
  where = lambda o, label, seed: run_dir(o, label, seed, name)
  return convergence.run_all(out, plan, jobs, timeout_s, launch=start, run_dir=where)


# -- collecting -----------------------------------------------------------------------------------


def steps_to(curve: dict, target: float) -> float:
  """The first update at which the eval loss reaches ``target`` (linear between evaluations;
  ``inf`` if never)."""
  prev_u, prev_l = 0, None
  for u, loss in zip(curve["update"], curve["loss"], strict=True):
    if loss <= target:
      if prev_l is None or prev_l <= target:
        return float(u)
      return prev_u + (prev_l - target) / (prev_l - loss) * (u - prev_u)
    prev_u, prev_l = u, loss
  return math.inf


def collect(
  out: Path,
  seeds: list[int],
  methods: list[str],
  programs: dict | None,
  name: str,
  target: float | None = None,
  recorded: dict | None = None,
):
  """The results of the runs of ``methods`` x ``seeds``: read from their directories, or, where a
  directory is gone, taken from ``recorded`` (the ``runs`` of an earlier JSON of this script)."""
  s = setting(name)
  s_conv = dict(s)  # convergence.read_run's setting keys
  runs: dict = {}
  for label in methods:
    for seed in seeds:
      d = run_dir(out, label, seed, name)
      if (d / "result.json").exists():
        runs.setdefault(label, {})[seed] = convergence.read_run(d, s_conv)
      elif str(seed) in (recorded or {}).get(label, {}):
        runs.setdefault(label, {})[seed] = recorded[label][str(seed)]
  summary = {}
  for label, by_seed in runs.items():
    finals = [r["final_eval_loss"] for r in by_seed.values()]
    summary[label] = {"final_eval_loss": convergence._mean_std(finals)}
  # the target: the loss every run reaches (the worst final eval loss of any run), unless given
  finals = [r["final_eval_loss"] for by_seed in runs.values() for r in by_seed.values()]
  finals = [f for f in finals if math.isfinite(f)]
  target = target if target is not None else (max(finals) if finals else math.nan)
  for label, row in summary.items():
    prog = (programs or {}).get(label)
    curves = [r["eval"] for r in runs[label].values()]
    steps = statistics.fmean(steps_to(c, target) for c in curves)
    row["steps_to_target"] = steps
    if prog is None:
      continue
    per_step = _hlo_bytes_per_step(label, prog)
    tokens_per_worker = prog["tokens_per_step"] / prog["workers"]
    row["hlo_bytes_per_worker_per_token"] = per_step / tokens_per_worker
    row["peak_sync_bytes"] = max(prog["accounting"]["sync_wire"].values())
    row["state_bytes_per_device"] = prog["state_per_device"]
    row["time_to_target_s"] = {
      str(g): project(label, prog, steps, g)["time_s"] if math.isfinite(steps) else math.inf
      for g in GBITS
    }
  return {"runs": runs, "summary": summary, "setting": s, "programs": programs, "target": target}


def _hlo_bytes_per_step(label: str, prog: dict) -> float:
  """Bytes a worker sends per inner step, from the compiled programs: the step's own program, and
  each sync (window, apply) program once per ``H`` steps; ACCO runs two stages per update."""
  sent = {k: v["sent_per_worker"] for k, v in prog["programs"].items()}
  every = prog["accounting"]["sync_every"]
  per_step = sum(v for k, v in sent.items() if k in ("stage", "sync", "delayed"))
  per_step += sum(v / every for k, v in sent.items() if k not in ("stage", "sync", "delayed"))
  return per_step * (2 if label == "acco" else 1)


def table(results: dict) -> str:
  """The markdown table of docs/benchmarks/loco.md's "LoCo comparison"."""
  g = " / ".join(f"{x:g}" for x in GBITS)
  lines = [
    f"| method | eval loss | bytes/worker/token (HLO) | peak bytes/sync | state bytes/device "
    f"(params + opt + comm) | steps to {results['target']:.3f} | modelled time to it at {g} "
    "Gbit/s |",
    "|---|---|---|---|---|---|---|",
  ]
  for label, row in results["summary"].items():
    loss = row["final_eval_loss"]
    spread = f" ± {loss['std']:.3f} ({loss['n']} seeds)" if loss["n"] > 1 else " (1 seed)"
    if "hlo_bytes_per_worker_per_token" not in row:
      lines.append(f"| {label} | {loss['mean']:.3f}{spread} | | | | | |")
      continue
    st = row["state_bytes_per_device"]
    times = " / ".join(_seconds(row["time_to_target_s"][str(x)]) for x in GBITS)
    lines.append(
      f"| {label} | {loss['mean']:.3f}{spread} | {row['hlo_bytes_per_worker_per_token']:,.1f} | "
      f"{row['peak_sync_bytes']:,.0f} | {st['params']:,} + {st['optimizer']:,} + "
      f"{st['communication']:,} | {row['steps_to_target']:.0f} | {times} |"
    )
  return "\n".join(lines)


def _seconds(t: float) -> str:
  return "never" if not math.isfinite(t) else f"{t:,.0f} s"


def figure(results: dict, path: Path) -> Path | None:
  """Eval loss against tokens (seed means), and final eval loss against bytes per token."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    common.log("matplotlib is not installed: no figure (pip install matplotlib)")
    return None
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
  for label, by_seed in results["runs"].items():
    curves = [r["eval"] for r in by_seed.values()]
    n = min(len(c["tokens"]) for c in curves)
    mean = [statistics.fmean(c["loss"][i] for c in curves) for i in range(n)]
    ax.plot([t / 1e3 for t in curves[0]["tokens"][:n]], mean, label=label)
    row = results["summary"][label]
    if "hlo_bytes_per_worker_per_token" in row:
      x = row["hlo_bytes_per_worker_per_token"]
      bx.scatter([x], [row["final_eval_loss"]["mean"]])
      bx.annotate(label, (x, row["final_eval_loss"]["mean"]), fontsize=8)
  ax.axhline(results["target"], color="grey", lw=0.8, ls="--")
  ax.set(xlabel="tokens (thousands)", ylabel="eval loss", title="eval loss (mean over seeds)")
  ax.legend(fontsize=8)
  bx.set_xscale("log")
  bx.set(
    xlabel="bytes sent per worker per token (compiled HLO)",
    ylabel="final eval loss",
    title="loss against communication",
  )
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=Path, default=common.RESULTS)
  p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
  p.add_argument(
    "--methods",
    nargs="+",
    default=list(METHODS),
    help="labels; method@<lr> or method@group.field=value,... for a sweep",
  )
  p.add_argument("--jobs", type=int, default=1)
  p.add_argument("--timeout", type=float, default=3600)
  p.add_argument("--collect", action="store_true")
  p.add_argument("--smoke", action="store_true", help="CI-size: tiny model, 2 steps, seed 0")
  p.add_argument("--setting", default="d8", choices=list(SETTINGS), help="the runs' setting")
  p.add_argument("--json", default="loco_compare.json")
  p.add_argument(
    "--target",
    type=float,
    help="eval loss of the time to target (default: the worst final of any run)",
  )
  p.add_argument("--train-worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--worker", dest="programs_worker", help=argparse.SUPPRESS)
  p.add_argument("--workdir", help=argparse.SUPPRESS)
  p.add_argument("--method", help=argparse.SUPPRESS)
  p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.train_worker:
    train_worker(args)
    return 0
  if args.programs_worker:
    Path(args.programs_worker).write_text(json.dumps(programs_worker(args)))
    return 0
  if args.smoke:
    args.seeds, args.jobs, args.setting = [0], max(args.jobs, 1), "smoke"
  for label in args.methods:
    make_config(label, 0, args.setting)  # a typo stops here, before any run starts
  plan = [(m, k) for k in args.seeds for m in args.methods]  # seed-major
  t0 = time.time()
  failed = [] if args.collect else run_all(args.out, plan, args.jobs, args.timeout, args.setting)
  wall = None if args.collect else time.time() - t0
  extra = ["--methods", *args.methods, "--setting", args.setting]
  programs = common.run_worker(__spec__.name, setting(args.setting)["devices"], extra, timeout=3600)
  name = "loco_compare_smoke" if args.smoke else Path(args.json).stem
  path = args.out / f"{name}.json"
  # the runs an earlier JSON recorded are kept where their directories are gone
  recorded = json.loads(path.read_text())["runs"] if path.exists() else None
  results = collect(
    args.out, args.seeds, args.methods, programs, args.setting, args.target, recorded
  )
  results.update(machine=common.machine(), wall_s=wall)
  fig = figure(results, FIGURES / f"{name}.png" if not args.smoke else args.out / f"{name}.png")
  if fig is not None:
    common.log(f"wrote {fig}")
  return common.write_report(args.out, name, results, table(results), failed)


if __name__ == "__main__":
  sys.exit(main())
