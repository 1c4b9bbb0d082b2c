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
* bytes sent per worker per token and per sync, **read from the compiled programs** (each program
  compiled on the CPU-scale model, its collectives listed with :func:`acco_jax.analysis.hlo.hlo_collectives`,
  those that cross workers converted to bytes a worker sends with ring algorithms: all-reduce
  ``2 (M−1)/M`` of the buffer, all-gather ``(M−1)/M`` of its result, collective-permute its
  operand), beside the packed bytes of the accounting. XLA:CPU computes bf16 collectives in f32 and
  Streaming DiLoCo's FP4 is emulated in f32, so for those the HLO shows f32 and the accounting the
  bytes as sent; SparseLoCo's and DeMo's all-gathers move the packed bytes themselves;
* the optimizer and communication state per device (the programs' state shardings);
* the modelled time to reach a target eval loss with 8 x H100 per worker and 1, 10 or 100 Gbit/s
  between workers (:func:`acco_jax.analysis.perfmodel.time_to_target`; the assumptions are in
  :data:`PROJECTION`).

Usage::

  python bench/loco/loco_compare.py --jobs 2              # 8 methods x 3 seeds, then collect
  python bench/loco/loco_compare.py --collect             # rebuild the JSON, table and figure only
  python bench/loco/loco_compare.py --smoke --out /tmp/lc # CI-size: tiny model, 2 steps
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout: bench, acco_jax
from bench import common  # noqa: E402
from bench.dp import convergence  # noqa: E402

FIGURES = common.REPO / "docs" / "figures"

SETTING = dict(
  devices=8, workers=8, D=128, N=2, H=4, tokenizer="bpe:2048", seq_len=64, microbatch_size=1,
  microbatches=4, num_updates=400, eval_every=25, eval_batches=12, lr=2e-3,
)  # fmt: skip
SMOKE = dict(
  devices=8, workers=8, D=32, N=2, H=2, tokenizer="byte", seq_len=32, microbatch_size=1,
  microbatches=2, num_updates=4, eval_every=2, eval_batches=2, lr=2e-3,
)  # fmt: skip
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
# common.cpu_env already lets simulated devices wait 15 minutes for each other in a collective;
# on a loaded machine a wait of 20 s is normal, so warn only after 5 minutes.
QUIET_COLLECTIVES = "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300"
GBITS = (1.0, 10.0, 100.0)
# The projection to 8 x H100 per worker (docs/benchmarks.md, "LoCo comparison").
PROJECTION = {
  "model": "GPT-2 124M", "params": 124_439_808,
  "tokens_per_gpu_step": 6 * 8 * 1024,  # the gpt2 preset: 6 microbatches of 8 x 1024 per GPU
  "gpu_tokens_per_s": 285e3,  # measured: train.py zero1 on one H100 (docs/benchmarks.md)
  "gpus_per_worker": 8, "workers": 8,
  "nvlink_GBps": 450.0, "link_efficiency": 0.8, "latency_intra_s": 5e-6, "latency_inter_s": 50e-6,
}  # fmt: skip


def setting(smoke: bool) -> dict:
  return SMOKE if smoke else SETTING


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


def make_config(label: str, seed: int, smoke: bool = False):
  """The trainer config: the method's config file, shrunk to the setting (convergence.py's d8)."""
  sys.path.insert(0, str(common.REPO))
  import importlib

  base, sweep = parse_label(label)
  name, overrides = METHODS[base]
  overrides = {**overrides, **sweep}
  s = setting(smoke)
  c = importlib.import_module(f"configs.{name}").get_config("cpu")
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
  if smoke and base in LOCO and base != "demo":
    c.loco.sync_every = 2 * c.loco.fragments  # a fragment every 2 steps: tau = 1 fits in H/P
  return c


def train_worker(args) -> None:
  from acco_jax.run import trainer

  config = make_config(args.method, args.seed, args.smoke)
  start = time.perf_counter()
  result = {"method": args.method, "seed": args.seed}
  try:
    summary = trainer.train_and_evaluate(config, args.workdir)
    result.update(status="ok", final_eval_loss=summary.get("eval_loss"), summary=summary)
  except FloatingPointError as e:
    result.update(status="diverged", error=str(e), final_eval_loss=float("nan"))
  result["wall_s"] = time.perf_counter() - start
  result["config"] = json.loads(config.to_json_best_effort())
  shutil.rmtree(Path(args.workdir) / "checkpoints", ignore_errors=True)
  common.write_json(Path(args.workdir) / "result.json", result)


# -- bytes and state from the compiled programs (child process) -----------------------------------


def _sent(c, n: int) -> float:
  """Bytes one device sends for collective ``c`` among ``n`` devices (ring algorithms)."""
  if c.kind == "collective-permute":
    return float(c.bytes)
  one = (n - 1) / n * c.bytes
  return 2 * one if c.kind == "all-reduce" else one


def _program_sent(cross: list, n: int) -> float:
  """Bytes one device sends in one run of a program whose collectives across workers are
  ``cross``: NoLoCo's sync switches between one collective-permute per matching, of which one runs."""
  permutes = [_sent(c, n) for c in cross if c.kind == "collective-permute"]
  return sum(_sent(c, n) for c in cross if c.kind != "collective-permute") + max(
    permutes, default=0
  )


def programs_worker(args) -> dict:
  """Per method: bytes each program sends per worker (HLO and accounting), state per device."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from acco_jax.analysis import hlo
  from acco_jax.run import metrics, trainer

  s = setting(args.smoke)
  out = {}
  for label in args.methods:
    config = make_config(label, 0, args.smoke)
    run = trainer.build(config)
    train = run.train
    shapes = run.params_shapes
    state = train.abstract_state(shapes)
    n_dev = run.mesh.size
    rows = n_dev * train.num_microbatches * s["microbatch_size"]
    batch_sharding = NamedSharding(train.mesh, P(run.batch_axis))
    batch = {
      k: jax.ShapeDtypeStruct((rows, s["seq_len"]), jnp.int32, sharding=batch_sharding)
      for k in ("inputs", "targets")
    }
    progs = {}
    if run.loco:
      m = train.num_workers
      per = train.num_devices  # devices per worker
      progs["stage"] = (train._program("stage", None, state), (state, batch))
      meth = train.method
      for p in range(len(train.parts)):
        if meth.overlap_steps:
          stacked = [batch] * meth.overlap_steps
          progs[f"window{p}"] = (train._program("window", p, state), (state, stacked))
          progs[f"apply{p}"] = (train._program("apply", p, state), (state,))
        else:
          progs[f"sync{p}"] = (train._program("sync", p, state), (state,))
      group_of = lambda i, per=per: i // per
    else:
      m, per = n_dev, 1
      kind = "delayed" if train.plan.delayed else "sync"
      progs[kind] = (train._jit(kind, state), (state, batch))
      group_of = lambda i: i  # every device is a worker
    found = {}
    for name, (fn, fn_args) in progs.items():
      cs = hlo.hlo_collectives(fn.lower(*fn_args).compile().as_text())
      cross = [c for c in cs if hlo.crosses(c, group_of)]
      found[name] = {
        "collectives": [f"{c.kind} {c.shape} {c.bytes}B" for c in cross],
        "sent_per_worker": per * _program_sent(cross, m),
      }
    state_bytes = {
      part: common.shard_bytes(getattr(state, part) if hasattr(state, part) else ())
      for part in ("inner", "outer", "inflight", "comp", "params", "opt_state", "buf", "w")
    }
    if run.loco:
      inner = state.inner
      split = {
        "params": common.shard_bytes((inner.params, inner.w)),
        "optimizer": common.shard_bytes(inner.opt_state) + common.shard_bytes(state.outer),
        "communication": common.shard_bytes((state.inflight, state.comp)),
      }
      per_sync = {p: train.wire_bytes(p) for p in range(len(train.parts))}
      acct = {
        "sync_wire": per_sync, "payload": train.payload_bytes(0), "density": train.density(),
        "syncs_per_step": len(train.parts) / train.method.sync_every,
        "sync_every": train.method.sync_every, "overlap_steps": train.method.overlap_steps,
      }  # fmt: skip
    else:
      split = {
        "params": common.shard_bytes((state.params, state.w)),
        "optimizer": common.shard_bytes(state.opt_state),
        "communication": common.shard_bytes((state.buf, state.buf_count)),
      }
      stage = metrics.comm_bytes_per_stage(train.plan, train.layout.padded_size, n_dev)
      stages = 2 if train.plan.two_stage else 1
      acct = {"sync_wire": {0: stage * stages}, "payload": None, "density": 1.0,
              "syncs_per_step": 1.0, "sync_every": 1, "overlap_steps": 0}  # fmt: skip
    del state_bytes
    out[label] = {
      "programs": found,
      "accounting": acct,
      "state_per_device": split,
      "params": train.layout.num_params,
      "workers": m,
      "devices_per_worker": per,
      "tokens_per_step": tokens_per_update(s),
    }
    common.log(f"{label}: {json.dumps({k: v['sent_per_worker'] for k, v in found.items()})}")
  return out


# -- the driver ---------------------------------------------------------------------------------------


def run_dir(out: Path, label: str, seed: int) -> Path:
  return out / "runs" / "loco_compare" / label / f"seed{seed}"


def launch(out: Path, label: str, seed: int, smoke: bool) -> subprocess.Popen:
  d = run_dir(out, label, seed)
  if d.exists():
    shutil.rmtree(d)
  d.mkdir(parents=True)
  cmd = [sys.executable, __file__, "--train-worker", "--workdir", str(d), "--method", label,
         "--seed", str(seed)] + (["--smoke"] if smoke else [])  # fmt: skip
  log = open(d / "run.log", "w")
  env = common.cpu_env(setting(smoke)["devices"])
  env["XLA_FLAGS"] += " " + QUIET_COLLECTIVES
  proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=common.REPO)
  proc.log = log
  return proc


def run_all(out: Path, plan: list, jobs: int, timeout_s: float, smoke: bool) -> list[str]:
  """Runs the missing ``(label, seed)`` runs of ``plan`` with convergence.py's scheduler."""
  start = lambda o, label, seed: launch(o, label, seed, smoke)
  return convergence.run_all(out, plan, jobs, timeout_s, launch=start, run_dir=run_dir)


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


# ring hops of a sync (latency terms): all-reduce 2 (M-1), all-gather M-1, one pair exchange
HOPS = {
  "diloco": "ar",
  "streaming_diloco": "ar",
  "noloco": "pair",
  "sparseloco": "ag",
  "demo": "ag",
}


def project(
  label: str, prog: dict, steps: float, gbit: float, outer_overlap: str = "none",
  inner_method: str = "zero1",
) -> dict:  # fmt: skip
  """Modelled seconds to ``steps`` inner steps at ``gbit`` Gbit/s between workers.

  Data-parallel methods: :func:`acco_jax.analysis.perfmodel.step_time` on 8 nodes of 8 GPUs. LoCo methods:
  an inner step is ``inner_method`` (ZeRO-1, or ACCO: its collectives hidden behind its two halves)
  on one node of 8 GPUs (``inner_exposed_s``: what it waits for its own collectives); each sync of
  fragment ``p`` (every ``H`` steps)
  takes ``hops x latency + wire_p / bandwidth`` (``wire_p``: the accounting's bytes a worker sends,
  scaled from the CPU model to GPT-2's parameter count) and is hidden behind ``τ`` inner steps, or,
  with ``outer_overlap`` delayed or eager, behind the ``H/P`` inner steps of the phase it runs
  across (``P`` fragments; the whole ``H`` for DiLoCo and SparseLoCo).
  """
  from acco_jax.analysis import perfmodel as pm

  label = label.partition("@")[0]  # a sweep's run costs what its method costs at its H
  a = PROJECTION
  scale = a["params"] / prog["params"]  # bytes scale with the parameter count
  compute = a["tokens_per_gpu_step"] / a["gpu_tokens_per_s"]
  intra = pm.Link(a["nvlink_GBps"] * pm.GBYTE * a["link_efficiency"], a["latency_intra_s"])
  inter = pm.Link(gbit * pm.GBIT * a["link_efficiency"], a["latency_inter_s"])
  acct = prog["accounting"]
  if label in LOCO:
    m = a["workers"]
    k = 2 if inner_method == "acco" else 1
    inner = pm.step_time(
      inner_method, _work(a, compute, k), pm.Cluster(1, a["gpus_per_worker"], intra)
    )
    hops = {"ar": 2 * (m - 1), "ag": m - 1, "pair": 1}[HOPS[label]]
    hidden = acct["overlap_steps"]
    if outer_overlap != "none":
      hidden = acct["sync_every"] // len(acct["sync_wire"])
    exposed = 0.0
    for wire in acct["sync_wire"].values():
      t = hops * inter.latency + wire * scale / inter.bandwidth
      exposed += max(0.0, t - hidden * inner.time) / acct["sync_every"]
    step_s, compute_s, inner_exposed = inner.time + exposed, inner.compute, inner.exposed
  else:
    cluster = pm.Cluster(a["workers"], a["gpus_per_worker"], intra, inter)
    st = pm.step_time(label, _work(a, compute, 2 if label == "acco" else 1), cluster)
    step_s, compute_s, exposed, inner_exposed = st.time, st.compute, st.exposed, 0.0
  return {
    "step_s": step_s,
    "exposed_s": exposed,
    "inner_exposed_s": inner_exposed,
    "time_s": steps * step_s,
    "compute_share": compute_s / step_s,
  }


def _work(a: dict, compute: float, k: int):
  from acco_jax.analysis import perfmodel as pm

  return pm.Workload(params=a["params"], microbatch_time=compute / k, microbatches=k)


def collect(
  out: Path,
  seeds: list[int],
  methods: list[str],
  programs: dict | None,
  smoke: bool,
  target: float | None = None,
  recorded: dict | None = None,
):
  """The results of the runs of ``methods`` x ``seeds``: read from their directories, or, where a
  directory is gone, taken from ``recorded`` (the ``runs`` of an earlier JSON of this script)."""
  s = setting(smoke)
  s_conv = dict(s)  # convergence.read_run's setting keys
  runs: dict = {}
  for label in methods:
    for seed in seeds:
      d = run_dir(out, label, seed)
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
  """The markdown table of docs/benchmarks.md's "LoCo comparison"."""
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
  bx.set(xlabel="bytes sent per worker per token (compiled HLO)", ylabel="final eval loss",
         title="loss against communication")  # fmt: skip
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
  p.add_argument("--smoke", action="store_true")
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
    args.seeds, args.jobs = [0], max(args.jobs, 1)
  for label in args.methods:
    make_config(label, 0, args.smoke)  # a typo stops here, before any run starts
  plan = [(m, k) for k in args.seeds for m in args.methods]  # seed-major
  t0 = time.time()
  failed = [] if args.collect else run_all(args.out, plan, args.jobs, args.timeout, args.smoke)
  wall = None if args.collect else time.time() - t0
  extra = ["--methods", *args.methods] + (["--smoke"] if args.smoke else [])
  programs = common.run_worker(__file__, setting(args.smoke)["devices"], extra, timeout=3600)
  name = "loco_compare_smoke" if args.smoke else Path(args.json).stem
  path = args.out / f"{name}.json"
  # the runs an earlier JSON recorded are kept where their directories are gone
  recorded = json.loads(path.read_text())["runs"] if path.exists() else None
  results = collect(args.out, args.seeds, args.methods, programs, args.smoke, args.target, recorded)
  results.update(machine=common.machine(), wall_s=wall)
  fig = figure(results, FIGURES / f"{name}.png" if not args.smoke else args.out / f"{name}.png")
  if fig is not None:
    common.log(f"wrote {fig}")
  return common.write_report(args.out, name, results, table(results), failed)


if __name__ == "__main__":
  sys.exit(main())
