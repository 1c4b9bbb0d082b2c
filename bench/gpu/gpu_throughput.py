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
  graphs) on; every other row runs with :data:`acco_jax.parallel.GPU_OVERLAP_FLAGS`, which turn
  them off (the multi-GPU overlap needs that; one GPU may not).

``--profile`` adds to each ``step:`` row a ``jax.profiler`` trace of 4 stages after the timed ones
(``<out>_<row>.trace.json.gz`` beside the JSON) and its table (``bench/gpu/profile_table.py``: GPU busy,
kernel time by kind, the largest kernels, per-stage gaps and device-to-host copies).

Every row records tokens/s, MFU (model FLOPs of the *real* vocabulary, :func:`model.flops_per_token`,
over the device's peak bf16 FLOP/s), and the device's peak memory. On a GPU each row runs in its own
process, so the peak memory is that row's. Writes a markdown table and JSON.

Usage::

  python -m bench.gpu.gpu_throughput                    # the full table (one GPU; ~10 min)
  python -m bench.gpu.gpu_throughput --only step:zero1,torch:V50304
  python -m bench.gpu.gpu_throughput --only adamw --append   # add rows to the JSON of an earlier run
  python -m bench.gpu.gpu_throughput --smoke            # tiny shapes on CPU, seconds (CI)
  python -m bench.gpu.gpu_throughput --profile --only trainer:zero1,step:zero1,trainer:acco,step:acco
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import common
from bench.gpu import throughput_rows

COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"


def _child(name: str, args, env: dict | None = None) -> dict:
  """One row in a fresh process (on a GPU: its own peak memory, no compile cache shared)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "row.json"
    cmd = [
      *common.module_command(__spec__.name),
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
    cmd += ["--profile"] * args.profile
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
    fmt.append(
      {
        "name": r["name"],
        "rows": r.get("rows", ""),
        "tok/s": f"{tps / 1e3:,.1f}k" if tps else r.get("skipped", r.get("error", "")[:40]) or "",
        "MFU": f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "",
        "ms/update": f"{1e3 * r['seconds_per_update']:.1f}" if "seconds_per_update" in r else "",
        "peak GiB": _peak_gib(r),
        "f32xf32 GEMMs": _f32_gemms(r),
      }
    )
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
  p.add_argument(
    "--append",
    action="store_true",
    help="keep the rows already in --out (same shapes, device and versions); "
    "re-measured rows replace theirs",
  )
  p.add_argument(
    "--profile",
    action="store_true",
    help="trace 4 stages of each step: row and add its profile table",
  )
  p.add_argument("--row", help=argparse.SUPPRESS)
  p.add_argument("--worker", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.smoke:  # before JAX starts: CPU only, even where a GPU plugin is installed
    os.environ["JAX_PLATFORMS"] = "cpu"
  args.steps = args.steps or (2 if args.smoke else 20)
  args.warmup = args.warmup or (1 if args.smoke else 3)
  from acco_jax import parallel

  parallel.configure_platform()  # train.py's XLA:GPU flags, for every row (before JAX starts)
  if args.worker:
    common.write_json(Path(args.worker), throughput_rows.run_row(args.row, args))
    return
  import jax

  every = throughput_rows.SMOKE_ROWS if args.smoke else throughput_rows.ROWS
  names = [n for n in args.only.split(",") if n] or list(every)
  on_gpu = jax.default_backend() == "gpu"
  out = Path(args.out)
  rows = _earlier_rows(out, args) if args.append else {}
  for name in names:
    if name.startswith("hlo:") and not on_gpu:  # the host compiles for an abstract GPU
      row = _child(name, args, {"JAX_PLATFORMS": "cpu"})
    elif on_gpu and not args.smoke:
      row = _child(name, args)
    else:
      row = throughput_rows.run_row(name, args)
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
  return " ".join(["python", "-m", "bench.gpu.gpu_throughput", *sys.argv[1:]])


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
    "shapes": throughput_rows.shapes(args),
    "steps": args.steps,
    "warmup": args.warmup,
  }


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  main()
