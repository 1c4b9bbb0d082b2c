"""Peak host memory of the SmolLM2 fine-tune on a CPU (``configs/sft_acco.py``,
``model.init=hf:<dir>``, 1 row per microbatch, 4 updates), before and after issue 68's memory
work, beside the run's own prediction (acco_jax/run/memory.py).

Each row is ``train.py`` in a child process: its peak resident memory is the kernel's
``ru_maxrss`` of that child (``os.wait4``), an independent count. A sampler stops a child whose
resident memory passes ``--limit-gb`` (default 14 GB, so that a measurement cannot take a shared
machine down): such a row reads "over the limit". ``--repo`` names a checkout of the code before
(a worktree of the commit; its ``train.py`` and package run, this file's harness measures).
Rows: on 1 device and on the preset's devices (before: the preset's 8; after: what
``mesh.fit_memory`` picks, printed by the run).

Usage::

  git worktree add /tmp/before 7701a48
  python -m bench.run.sft_memory --model /work/smollm2 --repo-before /tmp/before
  python -m bench.run.sft_memory --smoke --out /tmp/m.json    # tests: the tiny preset, 1 device
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import common

GB = 1e9
FLAGS = [
  "--config.batch.microbatch_size=1",
  "--config.train.num_updates=4",
  "--config.opt.warmup_updates=1",
  "--config.train.eval_every=0",
  "--config.train.eval_batches=2",
  "--config.train.answer_prompts=4",
  "--config.train.answer_tokens=8",
  "--config.ckpt.every=0",
]


def _rss(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def run_once(repo: Path, args: list[str], limit: float, timeout: float = 3600) -> dict:
  """``train.py args`` of ``repo`` in a child: its peak resident bytes (``ru_maxrss``), whether it
  was stopped at ``limit`` bytes, its exit status, wall time and the host peak it predicted."""
  env = {**os.environ, "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  with tempfile.TemporaryDirectory() as tmp:
    out = open(os.path.join(tmp, "out.txt"), "w+")
    t0 = time.time()
    child = subprocess.Popen(
      [sys.executable, "train.py", "--workdir", os.path.join(tmp, "run"), *args],
      cwd=repo,
      env=env,
      stdout=out,
      stderr=subprocess.STDOUT,
    )
    stopped = threading.Event()

    def watch():
      while child.poll() is None:
        if _rss(child.pid) > limit or time.time() - t0 > timeout:
          stopped.set()
          child.kill()
          return
        time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    watcher.join()
    out.seek(0)
    text = out.read()
  predicted = re.search(r"host peak ([\d.]+) GB", text)
  devices = re.search(r"devices=(\d+)", text)
  return {
    "peak_bytes": usage.ru_maxrss * 1024,
    "over_limit": stopped.is_set(),
    "returncode": child.returncode,
    "wall_s": time.time() - t0,
    "predicted_host_bytes": float(predicted.group(1)) * GB if predicted else None,
    "devices": int(devices.group(1)) if devices else None,
    "tail": text[-600:],
  }


def measure(model: str, before: Path | None, limit: float, smoke: bool) -> list[dict]:
  if smoke:
    config = ["--config", "configs/gpt2_acco.py:tiny"]
    cases = [("after", common.REPO, ["--config.mesh.cpu_devices=1"])]
  else:
    config = ["--config", "configs/sft_acco.py", f"--config.model.init=hf:{model}", *FLAGS]
    cases = [("after", common.REPO, ["--config.mesh.cpu_devices=1"]), ("after", common.REPO, [])]
    if before is not None:
      cases = [
        ("before", before, ["--config.mesh.cpu_devices=1"]),
        *cases[:1],
        ("before", before, []),
        *cases[1:],
      ]
  rows = []
  for version, repo, extra in cases:
    r = run_once(Path(repo), [*config, *extra], limit)
    r.update(version=version, preset_devices=not extra)
    rows.append(r)
    peak = f"over {limit / GB:.0f} GB" if r["over_limit"] else f"{r['peak_bytes'] / GB:.2f} GB"
    common.log(f"{version} devices={r['devices']}: peak {peak}, rc {r['returncode']}")
  return rows


def table(rows: list[dict], limit: float) -> str:
  lines = [
    "| code | devices | peak RSS GB (measured) | predicted host peak GB | exit | wall s |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    peak = f"> {limit / GB:.0f} (stopped)" if r["over_limit"] else f"{r['peak_bytes'] / GB:.2f}"
    pred = "" if r["predicted_host_bytes"] is None else f"{r['predicted_host_bytes'] / GB:.2f}"
    devices = f"{r['devices']}{' (preset)' if r['preset_devices'] else ''}"
    lines.append(
      f"| {r['version']} | {devices} | {peak} | {pred} | {r['returncode']} | {r['wall_s']:.0f} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="/work/smollm2", help="a Hugging Face directory (SmolLM2)")
  p.add_argument("--repo-before", type=Path, default=None, help="a checkout of the code before")
  p.add_argument("--limit-gb", type=float, default=14.0, help="stop a child past this RSS")
  p.add_argument("--smoke", action="store_true", help="the tiny preset on 1 device (tests)")
  p.add_argument("--out", type=Path, default=common.RESULTS / "sft_memory.json")
  args = p.parse_args(argv)
  limit = args.limit_gb * GB
  rows = measure(args.model, args.repo_before, limit, args.smoke)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps({"rows": rows, "machine": common.machine()}, indent=2))
  print(table(rows, limit))
  return 0


if __name__ == "__main__":
  sys.exit(main())
