"""Peak host memory of loading a Hugging Face checkpoint (``model.init=hf:<dir>``), against the
checkpoint's size.

Writes a checkpoint of random weights of ``--size`` (GPT-2 medium by default: 355M parameters,
1.42 GB in float32) with :func:`acco_jax.hf.save`, in float32 and bfloat16, then loads each in a
fresh process on one CPU device, placed as the trainer places it
(:func:`acco_jax.run.pretrained.load_params`'s ``place``: each tensor put on the mesh as it is read).
Reported: the process's peak resident memory during the load above its resident memory just
before (``VmHWM`` reset through ``/proc/self/clear_refs``), against the file's size and against the
float32 parameters the load produces. On a CPU the placed parameters live in host memory too, so
the floor is the float32 parameters themselves (1x a float32 checkpoint, 2x a bfloat16 one); what
the loader adds is the rest. Beside it, for contrast, a loader that reads every tensor first and
converts afterwards (``--contrast``), as reading a file whole does.

Usage::

  python -m bench.run.hf_load_memory                       # gpt2-medium, float32 and bfloat16
  python -m bench.run.hf_load_memory --smoke --out /tmp/m.json   # the tiny preset (tests)
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

GB = 1e9


def _rss(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"no {field} in /proc/self/status")


def child(directory: str, mode: str) -> dict:
  """Loads ``directory`` in this process; the peak resident bytes above the start."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from acco_jax import hf

  cfg = hf.model_config(directory)
  sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)), P())
  place = lambda path, x: jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])
  hf.check_weights(directory, cfg)  # imports and headers before the baseline
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current resident size
  before = _rss("VmRSS")
  if mode == "loader":
    params = hf.load_params(directory, cfg, place)
  else:  # contrast: every tensor read first, then converted and placed
    planned = hf.check_weights(directory, cfg)
    raw = [(t, np.array(hf._read(e))) for t, e in planned]
    params = [place(t.path, np.asarray(x.T if t.transpose else x, np.float32)) for t, x in raw]
  jax.block_until_ready(params)
  peak = _rss("VmHWM") - before
  placed = sum(x.nbytes for x in jax.tree.leaves(params))
  return {"peak_bytes": peak, "placed_bytes": placed}


def write_checkpoint(size: str, dtype: str, directory: str) -> int:
  """A checkpoint of random weights of GPT-2 ``size``; returns its weights' bytes."""
  import jax

  from acco_jax import hf, model

  cfg = model.get_config(size, dtype="float32")
  params = jax.jit(model.init_params, static_argnums=0)(cfg, 0)
  hf.save(directory, params, cfg, dtype=dtype)
  return sum(
    os.path.getsize(os.path.join(directory, f))
    for f in os.listdir(directory)
    if f.endswith(".safetensors")
  )


def measure(size: str, dtypes: list[str], contrast: bool) -> list[dict]:
  rows = []
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(common.REPO)}
  env.pop("XLA_FLAGS", None)
  for dtype in dtypes:
    with tempfile.TemporaryDirectory() as tmp:
      directory = os.path.join(tmp, "ckpt")
      file_bytes = write_checkpoint(size, dtype, directory)
      for mode in ("loader", "contrast") if contrast else ("loader",):
        code = (
          "import json, sys; from bench.run import hf_load_memory as m; "
          f"print(json.dumps(m.child({directory!r}, {mode!r})))"
        )
        out = subprocess.run(
          [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800
        )
        if out.returncode:
          raise RuntimeError(out.stderr[-2000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(
          {
            "size": size,
            "file_dtype": dtype,
            "mode": mode,
            "file_bytes": file_bytes,
            **r,
            "peak_over_file": r["peak_bytes"] / file_bytes,
            "peak_over_params": r["peak_bytes"] / r["placed_bytes"],
          }
        )
        common.log(f"{size} {dtype} {mode}: peak {r['peak_bytes'] / GB:.2f} GB")
  return rows


def table(rows: list[dict]) -> str:
  lines = [
    "| checkpoint | loader | file GB | float32 params GB | peak above start GB | peak / file | peak / params |",
    "|---|---|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
      f"| {r['size']} {r['file_dtype']} | {r['mode']} | {r['file_bytes'] / GB:.2f} | "
      f"{r['placed_bytes'] / GB:.2f} | {r['peak_bytes'] / GB:.2f} | "
      f"{r['peak_over_file']:.2f}x | {r['peak_over_params']:.2f}x |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--size", default="gpt2-medium")
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--contrast", action="store_true", help="also read every tensor first")
  p.add_argument("--smoke", action="store_true", help="the tiny preset, float32 (tests)")
  p.add_argument("--out", type=Path, default=common.RESULTS / "hf_load_memory.json")
  args = p.parse_args(argv)
  size, dtypes = ("tiny", ["float32"]) if args.smoke else (args.size, args.dtypes.split(","))
  rows = measure(size, dtypes, args.contrast)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps({"rows": rows, "machine": common.machine()}, indent=2))
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
