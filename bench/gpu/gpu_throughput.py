"""GPT-2 124M training throughput on one GPU: train.py, the bare step, fwd+bwd, and a PyTorch peer.

Rows (``--only`` picks some by name):

* ``trainer:<method>`` (zero1, ddp, acco): :func:`acco_jax.run.trainer.train_and_evaluate` on the
  ``gpt2`` preset of that method, one device, the embedded corpus with the GPT-2 tokenizer, no
  evaluation or sample until the end; tokens/s from its metrics between the first log line after
  ``--warmup`` updates and the last one (data prefetch, logging and all).
* ``step:<method>``: :func:`acco_jax.make_train_step` alone on fixed random batches (the same
  shapes), timed over ``--steps`` updates after ``--warmup``.
* ``fwdbwd:V<n>`` / ``fwdbwd:xla``: ``jit(value_and_grad(loss_fn))`` on one microbatch at bf16
  weights, with the vocabulary unpadded (50257), padded (``vocab_multiple=128``: 50304), and padded
  with ``attention='xla'``.
* ``adamw``: the ``optax.adamw`` update of the 124M float32 parameters alone (ms).
* ``hlo:<method>``: the GEMMs of the method's compiled stage by operand dtypes (the "no float32 x
  float32 GEMM" target) and XLA's memory estimate; compiled for an abstract H100 through the CUDA
  PJRT plugin where no GPU is visible.
* ``torch:V<n>``: ``bench/gpu/torch_gpt.py`` (torch.compile, SDPA, fused AdamW, bf16 autocast, clip
  1.0, the same microbatches per update) where ``torch`` imports; skipped otherwise.
* ``<row>+cb`` (``trainer:`` and ``step:`` rows): the same with XLA:GPU's command buffers (CUDA
  graphs) on; every other row runs with :data:`acco_jax.run.parallel.GPU_OVERLAP_FLAGS`, which turn
  them off (the multi-GPU overlap needs that; one GPU may not).

``--profile`` adds to each ``step:`` row a ``jax.profiler`` trace of 4 stages after the timed ones
(``<out>_<row>.trace.json.gz`` beside the JSON) and its table (``bench/gpu/profile_table.py``: GPU busy,
kernel time by kind, the largest kernels, per-stage gaps and device-to-host copies).

Every row records tokens/s, MFU (model FLOPs of the *real* vocabulary, :func:`model.flops_per_token`,
over the device's peak bf16 FLOP/s), and the device's peak memory. On a GPU each row runs in its own
process, so the peak memory is that row's. Writes a markdown table and JSON.

Usage::

  python bench/gpu/gpu_throughput.py                    # the full table (one GPU; ~10 min)
  python bench/gpu/gpu_throughput.py --only step:zero1,torch:V50304
  python bench/gpu/gpu_throughput.py --only adamw --append   # add rows to the JSON of an earlier run
  python bench/gpu/gpu_throughput.py --smoke            # tiny shapes on CPU, seconds (CI)
  python bench/gpu/gpu_throughput.py --profile --only trainer:zero1,step:zero1,trainer:acco,step:acco
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout: bench, acco_jax
from bench import common  # noqa: E402

COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
ROWS = ("trainer:zero1", "trainer:ddp", "trainer:acco", "step:zero1", "step:acco",
        "fwdbwd:V50257", "fwdbwd:V50304", "fwdbwd:xla", "adamw", "torch:V50257", "torch:V50304",
        "hlo:zero1", "hlo:acco")  # fmt: skip
SMOKE_ROWS = ("trainer:zero1", "trainer:acco", "step:zero1", "step:acco", "fwdbwd:V1000",
              "fwdbwd:V1024", "fwdbwd:xla", "adamw", "torch:V1000", "hlo:zero1")  # fmt: skip


def _shapes(args) -> dict:
  """The model and batch: GPT-2 124M at the gpt2 preset, or a tiny one with ``--smoke``."""
  if args.smoke:
    return dict(size="tiny", V=1000, L=32, D=64, H=4, N=2, B=2, k=2, multiple=128)
  return dict(size="gpt2", V=50257, L=1024, D=768, H=12, N=12, B=8, k=6, multiple=128)


def _model_cfg(s: dict, *, padded=True, attention="auto"):
  from acco_jax import model

  return model.get_config(
    s["size"], V=s["V"], L=s["L"], D=s["D"], H=s["H"], N=s["N"], attention=attention,
    vocab_multiple=s["multiple"] if padded else 1,
  )  # fmt: skip


def _peak_bytes():
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def _timed(fn, steps: int, warmup: int) -> float:
  """Seconds per call of ``fn`` (returns arrays) after ``warmup`` calls."""
  import jax

  for _ in range(warmup):
    jax.block_until_ready(fn())
  start = time.perf_counter()
  for _ in range(steps):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps


def _inner_optimizer():
  import optax

  return optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
  )


def run_step(method: str, s: dict, args) -> dict:
  import jax
  import numpy as np

  import acco_jax
  from acco_jax import model
  from acco_jax.run import parallel

  cfg = _model_cfg(s)
  k = s["k"] // 2 if method == "acco" else s["k"]  # ACCO: an update is two stages of k/2
  mesh = parallel.make_mesh(1)
  params = model.init_params(cfg, 0)
  tx = getattr(acco_jax, method)(_inner_optimizer())
  loss = lambda p, b: model.loss_fn(p, cfg, b)
  train = acco_jax.make_train_step(loss, tx, mesh, num_microbatches=k, params=params, has_aux=True)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.V, size=(k * s["B"], s["L"] + 1), dtype=np.int32)
  batch = parallel.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
  state = train.init(params, jax.tree.map(lambda x: x[: s["B"]], batch))
  box = {"state": state}

  def one():
    box["state"], m = train.step(box["state"], batch)
    return m["loss"]

  stages = 2 if method == "acco" else 1
  seconds = _timed(one, args.steps * stages, args.warmup * stages) * stages  # per update
  out = {"seconds_per_update": seconds, "tokens_per_update": s["k"] * s["B"] * s["L"]}
  if args.profile:  # beside the JSON: <out>_step_<method>.trace.json.gz
    from bench.gpu import profile_table

    keep = Path(args.out).with_suffix("").as_posix() + f"_step_{method}.trace.json.gz"
    out["profile"] = profile_table.trace_calls(one, keep)
  return out


def run_trainer(method: str, s: dict, args) -> dict:
  from acco_jax import data, model
  from acco_jax.run import trainer
  from configs import common

  config = common.get_base("gpt2", method)
  if args.smoke:
    config.model.size, config.model.D, config.model.N, config.model.H = (
      "tiny",
      s["D"],
      s["N"],
      s["H"],
    )
    config.data.tokenizer, config.mesh.cpu_devices = "byte", 0
  config.data.seq_len = s["L"]
  config.batch.microbatch_size, config.batch.microbatches = s["B"], s["k"]
  config.mesh.num_devices = 1
  config.train.num_updates = args.warmup + args.steps
  config.opt.warmup_updates = 0  # the schedule does not change the speed
  config.train.log_every = 1
  config.train.eval_every, config.train.eval_batches, config.train.sample_tokens = 0, 1, 0
  config.ckpt.every, config.ckpt.async_save = 0, True
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train_and_evaluate(config, workdir)
    rows = [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  rows = [r for r in rows if "loss" in r and "tokens_per_s" in r and r["update"] >= args.warmup]
  first, last = rows[0], rows[-1]
  seconds = (last["wall_s"] - first["wall_s"]) / max(last["update"] - first["update"], 1)
  tokens = (last["tokens_seen"] - first["tokens_seen"]) / max(last["update"] - first["update"], 1)
  V = data.get_tokenizer(config.data.tokenizer).vocab_size
  rows = model.get_config("tiny", V=V, vocab_multiple=config.model.vocab_multiple).padded_vocab
  return {"seconds_per_update": seconds, "tokens_per_update": tokens, "rows": rows}


def run_fwdbwd(variant: str, s: dict, args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from acco_jax import model

  padded = variant != f"V{s['V']}"
  cfg = _model_cfg(s, padded=padded, attention="xla" if variant == "xla" else "auto")
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.init_params(cfg, 0))
  tokens = np.random.default_rng(0).integers(0, cfg.V, size=(s["B"], s["L"] + 1), dtype=np.int32)
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
  fn = jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, cfg, batch)[0]))
  seconds = _timed(lambda: fn(params), args.steps * 3, args.warmup)
  return {
    "seconds_per_update": seconds,
    "tokens_per_update": s["B"] * s["L"],
    "rows": cfg.padded_vocab,
  }


def run_adamw(s: dict, args) -> dict:
  """One ``optax.adamw`` update of the float32 parameters: per jitted call (as the earlier
  measurement took it: the host passes ~600 arrays each call), and per update inside one program
  (a ``fori_loop`` of updates: the device's time alone, as inside the train step)."""
  import jax
  import optax

  from acco_jax import model

  params = model.init_params(_model_cfg(s), 0)
  tx = optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
  update = jax.jit(lambda g, o, p: optax.apply_updates(p, tx.update(g, o, p)[0]))
  opt = tx.init(params)
  seconds = _timed(lambda: update(params, opt, params), args.steps * 3, args.warmup)

  def body(_, carry):
    p, o = carry
    u, o = tx.update(p, o, p)  # the parameters stand in for the gradients, as above
    return optax.apply_updates(p, u), o

  n = args.steps * 3
  loop = jax.jit(lambda p, o: jax.lax.fori_loop(0, n, body, (p, o)))
  in_program = _timed(lambda: loop(params, opt), 1, 1) / n
  return {
    "seconds_per_update": seconds,
    "seconds_in_program": in_program,
    "tokens_per_update": None,
  }


def run_torch(variant: str, s: dict, args) -> dict:
  try:
    from bench.gpu import torch_gpt
  except ImportError as e:
    return {"skipped": f"torch is not installed ({e})"}
  rows = int(variant.removeprefix("V"))
  out = torch_gpt.run(
    rows=rows, V=s["V"], L=s["L"], D=s["D"], H=s["H"], N=s["N"], B=s["B"], k=s["k"],
    steps=args.steps, warmup=args.warmup, compile=not args.smoke,
  )  # fmt: skip
  return {"seconds_per_update": out["step_s"], "tokens_per_update": s["k"] * s["B"] * s["L"],
          "peak_bytes": out["peak_bytes"], "torch": out["torch"], "rows": rows}  # fmt: skip


def run_hlo(method: str, s: dict, args) -> dict:
  """The GEMMs of the method's compiled stage, by operand dtypes, and XLA's memory estimate.

  On a GPU: the step as it runs (cuDNN attention). Elsewhere: compiled for an abstract H100 by the
  CUDA PJRT plugin, with ``attention='xla'`` (cuDNN attention cannot compile without a GPU); that
  fallback's score GEMMs are float32 by design and counted apart.
  """
  import jax

  import acco_jax
  from acco_jax import model
  from acco_jax.analysis import kernels
  from acco_jax.run import parallel

  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not parallel.has_cuda_plugin():
    return {"skipped": "no GPU and no CUDA PJRT plugin to compile for one"}
  devices = jax.devices()[:1] if on_gpu else parallel.gpu_aot_devices(1, "h100")
  cfg = _model_cfg(s, attention="auto" if on_gpu else "xla")
  k = s["k"] // 2 if method == "acco" else s["k"]
  tx = getattr(acco_jax, method)(_inner_optimizer())
  fn, fargs, _ = common.abstract_stage(cfg, tx, devices, k, s["B"])
  compiled = fn.lower(*fargs).compile()
  gemms = kernels.gemms(compiled.as_text())
  f32 = [g for g in gemms if set(g.dtypes) == {"f32"}]
  scores = [g for g in f32 if "BTNH,BSNH->BNTS" in g.op_name]  # attention='xla' only
  mem = compiled.memory_analysis()
  return {
    "compiled_for": devices[0].device_kind + ("" if on_gpu else " (abstract)"),
    "attention": model.attention_impl(cfg),
    "gemms": dict(collections.Counter("x".join(g.dtypes) for g in gemms)),
    "f32_gemms": len(f32),
    "f32_gemms_outside_attention_scores": len(f32) - len(scores),
    "argument_bytes": getattr(mem, "argument_size_in_bytes", None),
    "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
    "tokens_per_update": None,
  }


def run_row(name: str, args) -> dict:
  """One row, measured in this process."""
  import jax

  from acco_jax import model
  from acco_jax.run import metrics

  s = _shapes(args)
  kind, _, variant = name.removesuffix("+cb").partition(":")
  start = time.perf_counter()
  if kind == "trainer":
    out = run_trainer(variant, s, args)
  elif kind == "step":
    out = run_step(variant, s, args)
  elif kind == "fwdbwd":
    out = run_fwdbwd(variant, s, args)
  elif kind == "adamw":
    out = run_adamw(s, args)
  elif kind == "torch":
    out = run_torch(variant, s, args)
  elif kind == "hlo":
    out = run_hlo(variant, s, args)
  else:
    raise SystemExit(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
  out.update(name=name, wall_s=round(time.perf_counter() - start, 1))
  if "skipped" in out:
    return out
  out.setdefault("peak_bytes", _peak_bytes())
  out.setdefault("rows", s["V"] if name.endswith(f"V{s['V']}") else _model_cfg(s).padded_vocab)
  if out["tokens_per_update"]:
    out["tokens_per_s"] = out["tokens_per_update"] / out["seconds_per_update"]
    peak = metrics.peak_flops(jax.devices()[0])
    flops = model.flops_per_token(_model_cfg(s))  # the real vocabulary
    out["mfu"] = out["tokens_per_s"] * flops / peak if peak else None
  return out


def _child(name: str, args, env: dict | None = None) -> dict:
  """One row in a fresh process (on a GPU: its own peak memory, no compile cache shared)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "row.json"
    cmd = [
      sys.executable,
      __file__,
      "--row",
      name,
      "--worker",
      str(out),
      "--out",
      args.out,
      "--steps",
      str(args.steps),
      "--warmup",
      str(args.warmup),
    ] + ["--smoke"] * args.smoke
    cmd += ["--profile"] * args.profile  # fmt: skip
    env = {**os.environ, **(env or {})}
    if name.endswith("+cb"):  # the user's XLA_FLAGS win over configure_platform's defaults
      env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), COMMAND_BUFFERS]).strip()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if proc.returncode != 0 or not out.exists():
      return {"name": name, "error": proc.stdout[-2000:]}
    return json.loads(out.read_text())


def summarise(rows: dict) -> dict:
  """The issue's targets, where the rows needed are present."""
  rate = lambda n: rows.get(n, {}).get("tokens_per_s")
  ratio = lambda a, b: rate(a) / rate(b) if rate(a) and rate(b) else None
  torch_row = next((n for n in rows if n.startswith("torch:") and n != "torch:V50257"), None)
  hlo_rows = [r for n, r in rows.items() if n.startswith("hlo:") and "gemms" in r]
  busy = lambda n: rows.get(n, {}).get("profile", {}).get("gpu_busy")
  return {
    "trainer/step zero1 (>= 0.98)": ratio("trainer:zero1", "step:zero1"),
    "trainer/step acco (>= 0.98)": ratio("trainer:acco", "step:acco"),
    "trainer acco/zero1 (>= 0.95)": ratio("trainer:acco", "trainer:zero1"),
    "trainer zero1/torch padded (>= 1.1)": ratio("trainer:zero1", torch_row) if torch_row else None,
    "trainer zero1 MFU (>= 0.40)": rows.get("trainer:zero1", {}).get("mfu"),
    "bare step GPU busy, zero1 (>= 0.99)": busy("step:zero1"),
    "bare step GPU busy, acco (>= 0.99)": busy("step:acco"),
    "command buffers on / off, trainer zero1": ratio("trainer:zero1+cb", "trainer:zero1"),
    "f32 x f32 GEMMs in the steps, xla attention's scores apart (== 0)": (
      sum(r["f32_gemms_outside_attention_scores"] for r in hlo_rows) if hlo_rows else None
    ),
  }


def _f32_gemms(r: dict) -> str:
  if "gemms" not in r:
    return ""
  scores = r["f32_gemms"] - r["f32_gemms_outside_attention_scores"]
  return f"{r['f32_gemms_outside_attention_scores']}" + (f" (+{scores} scores)" if scores else "")


def _peak_gib(r: dict) -> str:
  if r.get("peak_bytes"):
    return f"{r['peak_bytes'] / 2**30:.1f}"
  if r.get("temp_bytes") is not None:  # XLA's estimate: arguments + temporaries
    return f"~{(r['argument_bytes'] + r['temp_bytes']) / 2**30:.1f}"
  return ""


def table(rows: list[dict]) -> str:
  fmt = []
  for r in rows:
    tps = r.get("tokens_per_s")
    fmt.append({
      "name": r["name"],
      "rows": r.get("rows", ""),
      "tok/s": f"{tps / 1e3:,.1f}k" if tps else r.get("skipped", r.get("error", "")[:40]) or "",
      "MFU": f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "",
      "ms/update": f"{1e3 * r['seconds_per_update']:.1f}" if "seconds_per_update" in r else "",
      "peak GiB": _peak_gib(r),
      "f32xf32 GEMMs": _f32_gemms(r),
    })  # fmt: skip
  cols = [
    (c, c) for c in ("name", "rows", "tok/s", "MFU", "ms/update", "peak GiB", "f32xf32 GEMMs")
  ]
  return common.format_table(fmt, cols)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, in one process")
  p.add_argument("--only", default="", help="comma-separated row names")
  p.add_argument("--steps", type=int, default=None, help="timed updates (default 20; smoke 2)")
  p.add_argument("--warmup", type=int, default=None, help="untimed updates (default 3; smoke 1)")
  p.add_argument("--out", default=str(common.RESULTS / "gpu_throughput.json"))
  p.add_argument("--append", action="store_true",
                 help="keep the rows already in --out (same shapes, device and versions); "
                      "re-measured rows replace theirs")  # fmt: skip
  p.add_argument("--profile", action="store_true",
                 help="trace 4 stages of each step: row and add its profile table")  # fmt: skip
  p.add_argument("--row", help=argparse.SUPPRESS)
  p.add_argument("--worker", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.smoke:  # before JAX starts: CPU only, even where a GPU plugin is installed
    os.environ["JAX_PLATFORMS"] = "cpu"
  args.steps = args.steps or (2 if args.smoke else 20)
  args.warmup = args.warmup or (1 if args.smoke else 3)
  sys.path.insert(0, str(common.REPO))  # configs/
  from acco_jax.run import parallel

  parallel.configure_platform()  # train.py's XLA:GPU flags, for every row (before JAX starts)
  if args.worker:
    common.write_json(Path(args.worker), run_row(args.row, args))
    return
  import jax

  names = [n for n in args.only.split(",") if n] or list(SMOKE_ROWS if args.smoke else ROWS)
  on_gpu = jax.default_backend() == "gpu"
  out = Path(args.out)
  rows = _earlier_rows(out, args) if args.append else {}
  for name in names:
    if name.startswith("hlo:") and not on_gpu:  # the host compiles for an abstract GPU
      row = _child(name, args, {"JAX_PLATFORMS": "cpu"})
    elif on_gpu and not args.smoke:
      row = _child(name, args)
    else:
      row = run_row(name, args)
    row["command"] = _command()  # with --append, rows of one file can come from several runs
    common.log(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'error'})}")
    rows[name] = row
    result = _result(list(rows.values()), args)
    common.write_json(out, result)  # after every row: a run cut short keeps what it measured
  print(result["table"])
  print(json.dumps(result["targets"], indent=1))
  failed = [n for n in names if "error" in rows[n]]
  if failed:
    raise SystemExit("some rows failed: " + ", ".join(failed))


def _earlier_rows(out: Path, args) -> dict:
  """The rows of an earlier run in ``out`` (``--append``), by name; they must share its setup."""
  if not out.exists():
    return {}
  earlier = json.loads(out.read_text())
  mine = _setup(args)
  for key in ("shapes", "steps", "warmup", "device", "versions"):
    if earlier.get(key) != mine[key]:
      raise SystemExit(
        f"--append: {out} was measured with another {key} ({earlier.get(key)} vs {mine[key]}); "
        "write to a new --out or drop --append"
      )
  return {r["name"]: r for r in earlier["rows"]}


def _result(rows: list[dict], args) -> dict:
  return {
    **_setup(args),
    "rows": rows,
    "targets": summarise({r["name"]: r for r in rows}),
    "table": table(rows),
  }


def _command() -> str:
  return " ".join(["python", "bench/gpu/gpu_throughput.py", *sys.argv[1:]])


def _setup(args) -> dict:
  """What a row's numbers depend on besides its own code: the command, device, versions, shapes."""
  import jax

  versions = {"jax": jax.__version__}
  for mod in ("jaxlib", "flax", "optax", "torch"):
    try:
      versions[mod] = __import__(mod).__version__
    except ImportError:
      pass
  dev = jax.devices()[0]
  return {
    "benchmark": "gpu_throughput",
    "command": _command(),
    "device": getattr(dev, "device_kind", dev.platform),
    "backend": jax.default_backend(),
    "versions": versions,
    "machine": common.machine(),
    "shapes": _shapes(args),
    "steps": args.steps,
    "warmup": args.warmup,
  }


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  main()
