"""The ACCO paper's third experiment at CPU scale: instruction fine-tuning with acco, zero1, ddp and
dpu (warm-up 0 and 50), 3 seeds, from one model this project pre-trained and exported.

1. Pre-trains the README quick start's model (``configs/gpt2_acco.py``: 100 ACCO updates on the
   embedded corpus, 8 simulated devices) and exports it (``python -m acco_jax.export``).
2. Fine-tunes it on the embedded instruction set (``configs/sft_acco.py``: which book a verse is
   from; a verse's last word) from the Hugging Face directory (``model.init=hf:<export>``), once
   per method and seed, each a ``train.py`` process, evaluating every ``--eval-every`` updates:
   held-out response loss and the exact match of greedy replies to 32 held-out prompts.
3. Writes ``bench/results/sft.json``, ``sft.md`` (the final numbers, mean ± std over seeds) and
   ``docs/figures/sft.png`` (response loss and exact match against updates).

Runs are resumable (a finished run's ``metrics.jsonl`` is read, not rerun). Usage::

  python -m bench.dp.sft --jobs 2                       # about 2 hours on 2 cores
  python -m bench.dp.sft --smoke --out /tmp/sft         # one 2-update run of the fixtures (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import common

VARIANTS = {  # name -> train.py overrides
  # the pretrained model before fine-tuning: one update at a negligible learning rate
  "start": [
    "--config.method=acco",
    "--config.opt.lr=1e-12",
    "--config.train.num_updates=1",
    "--config.opt.warmup_updates=0",
  ],
  "acco": ["--config.method=acco"],
  "zero1": ["--config.method=zero1"],
  "ddp": ["--config.method=ddp"],
  "dpu-w0": ["--config.method=dpu", "--config.dpu_warmup_updates=0"],
  "dpu-w50": ["--config.method=dpu", "--config.dpu_warmup_updates=50"],  # the paper's
}


def _run(args: list[str], log: Path, env: dict) -> None:
  with open(log, "w") as f:
    proc = subprocess.run(args, cwd=common.REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
  if proc.returncode:
    raise RuntimeError(f"{' '.join(args[:4])} ... failed (exit {proc.returncode}): see {log}")


def _rows(workdir: Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _finished(workdir: Path) -> bool:
  return any("exact_match" in r and r.get("event") is None for r in _rows(workdir)[-3:])


def pretrain(root: Path, env: dict, updates: int) -> Path:
  """The quick start's run and its export (skipped when present)."""
  run, out = root / "pretrain", root / "pretrain-hf"
  if not (out / "config.json").exists():
    cmd = [
      sys.executable,
      "train.py",
      "--config",
      "configs/gpt2_acco.py",
      "--workdir",
      str(run),
      f"--config.train.num_updates={updates}",
      "--config.train.sample_tokens=0",
      f"--config.opt.warmup_updates={min(20, updates // 5)}",
    ]
    common.log(f"pre-training {run} ({updates} updates) ...")
    _run(cmd, root / "pretrain.log", env)
    _run([sys.executable, "-m", "acco_jax.export", str(run), str(out)], root / "export.log", env)
  return out


def finetune(root: Path, init: Path, variant: str, seed: int, args, env: dict) -> dict:
  workdir = root / f"{variant}-s{seed}"
  if not _finished(workdir):
    source = [f"--config.data.source={args.source}"] if args.source else []
    if args.source.startswith("jsonl:"):
      source.append("--config.data.format=prompt_completion")
    cmd = [
      sys.executable,
      "train.py",
      "--config",
      f"configs/sft_acco.py:{args.preset}",
      "--workdir",
      str(workdir),
      *source,
      f"--config.model.init=hf:{init}",
      f"--config.train.seed={seed}",
      f"--config.train.num_updates={args.updates}",
      f"--config.train.eval_every={1 if variant == 'start' else args.eval_every}",
      "--config.train.exact_match=every",
      f"--config.batch.microbatch_size={args.rows}",
      f"--config.opt.warmup_updates={min(10, args.updates // 5)}",
      *VARIANTS[variant],
    ]
    common.log(f"fine-tuning {workdir.name} ...")
    start = time.perf_counter()
    _run(cmd, root / f"{workdir.name}.log", env)
    common.log(f"{workdir.name}: {time.perf_counter() - start:.0f} s")
  rows = _rows(workdir)
  evals = [r for r in rows if "eval_loss" in r or "exact_match" in r]
  curve = {}
  for r in evals:
    curve.setdefault(r["update"], {}).update(
      {k: r[k] for k in ("eval_loss", "exact_match") if k in r}
    )
  start = next(r for r in rows if r.get("event") == "pretrained")
  throughput = next((r for r in rows if r.get("event") == "throughput"), {})
  return {
    "variant": variant,
    "seed": seed,
    "curve": [{"update": u, **v} for u, v in sorted(curve.items())],
    "tokens_per_s": throughput.get("tokens_per_s"),
    "init": start.get("init"),
  }


def _stats(values):
  import numpy as np

  v = np.asarray([x for x in values if x is not None], float)
  return (float(v.mean()), float(v.std())) if len(v) else (float("nan"), float("nan"))


def table(runs: list[dict]) -> str:
  lines = [
    "| method | final response loss | final exact match | exact match at the first evaluation | runs |",
    "|---|---:|---:|---:|---:|",
  ]
  for variant in VARIANTS:
    mine = [r for r in runs if r["variant"] == variant]
    if not mine:
      continue
    last = [r["curve"][-1] for r in mine]
    first = [r["curve"][0] for r in mine]
    loss, em, em0 = (
      _stats(x.get(k) for x in xs)
      for xs, k in ((last, "eval_loss"), (last, "exact_match"), (first, "exact_match"))
    )
    lines.append(
      f"| {variant} | {loss[0]:.3f} ± {loss[1]:.3f} | {em[0]:.1%} ± {em[1]:.1%} | "
      f"{em0[0]:.1%} ± {em0[1]:.1%} | {len(mine)} |"
    )
  return "\n".join(lines)


def figure(runs: list[dict], path: Path) -> None:
  """Each method's mean over seeds (line, markers) and its range (band); the pretrained start as a
  dashed level."""
  import matplotlib
  import numpy as np
  from matplotlib.ticker import PercentFormatter

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  keys = ("eval_loss", "exact_match")
  for i, variant in enumerate(VARIANTS):
    mine = [r for r in runs if r["variant"] == variant]
    if not mine:
      continue
    xs = [p["update"] for p in mine[0]["curve"]]
    for ax, key in zip(axes, keys, strict=True):
      ys = np.array([[p.get(key, np.nan) for p in r["curve"]] for r in mine], float)
      if variant == "start":  # before fine-tuning: one evaluation
        ax.axhline(np.nanmean(ys), color="gray", ls="--", label="pretrained start")
        continue
      ax.plot(xs, np.nanmean(ys, 0), "o-", color=f"C{i}", label=f"{variant} ({len(mine)} seeds)")
      ax.fill_between(xs, np.nanmin(ys, 0), np.nanmax(ys, 0), color=f"C{i}", alpha=0.15)
  axes[0].set(xlabel="update", ylabel="held-out response loss (nats)", yscale="log")
  axes[1].set(xlabel="update", ylabel="exact match, 32 held-out prompts")
  axes[1].yaxis.set_major_formatter(PercentFormatter(1.0))
  axes[0].legend(fontsize=8)
  fig.suptitle("Instruction fine-tuning of the quick start's model: mean and range over seeds")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--jobs", type=int, default=1)
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--updates", type=int, default=100)
  p.add_argument("--eval-every", type=int, default=20)
  p.add_argument("--rows", type=int, default=2, help="rows per device per microbatch")
  p.add_argument("--pretrain-updates", type=int, default=100)
  p.add_argument(
    "--init", default="", help="a Hugging Face directory to fine-tune (no pre-training)"
  )
  p.add_argument("--preset", default="cpu", help="of configs/sft_acco.py")
  p.add_argument("--source", default="", help="data.source (default: the preset's)")
  p.add_argument("--smoke", action="store_true", help="one 2-update acco run of the test fixtures")
  p.add_argument("--out", type=Path, default=common.RESULTS)
  args = p.parse_args(argv)
  if args.smoke:  # the test fixtures: a tiny GPT-2 directory, a file of short examples
    args.seeds, args.variants, args.updates, args.eval_every = "0", "acco", 2, 1
    args.rows = 1  # 8 rows a stage: the fixture file keeps 10 examples of data.seq_len=48
    args.init, args.preset = str(common.REPO / "tests" / "data" / "hf" / "gpt2"), "tiny"
    args.source = f"jsonl:{common.REPO / 'tests' / 'data' / 'reversals.jsonl'}"
  root = args.out / "runs" / "sft"
  root.mkdir(parents=True, exist_ok=True)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(common.REPO)}
  env.setdefault("JAX_COMPILATION_CACHE_DIR", str(root / "xla_cache"))
  started = time.perf_counter()
  init = Path(args.init) if args.init else pretrain(root, env, args.pretrain_updates)
  jobs = [(v, int(s)) for s in args.seeds.split(",") for v in args.variants.split(",")]
  with ThreadPoolExecutor(max(1, args.jobs)) as pool:
    runs = list(pool.map(lambda job: finetune(root, init, *job, args, env), jobs))
  text = table(runs)
  print(text)
  common.write_json(
    args.out / "sft.json",
    {
      "runs": runs,
      "table": text,
      "machine": common.machine(),
      "args": vars(args) | {"out": str(args.out)},
      "wall_s": round(time.perf_counter() - started, 1),
    },
  )
  (args.out / "sft.md").write_text(text + "\n")
  if not args.smoke:
    figure(runs, common.REPO / "docs" / "figures" / "sft.png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
