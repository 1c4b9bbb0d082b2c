"""What composes with what: every combination of the config's switches a user can write, built, into
``docs/compositions.md``.

Each cell is one config: the ``tiny`` preset of the method's config file on 8 simulated CPU devices
with the row's and the column's values set, handed to :func:`acco_jax.run.build.build` as
``train.py`` would (the model, the data, the mesh and the step are built; nothing is compiled but
the owner layout's probe). It reads **runs** (with the test that trains that combination, where one
does) or **no** and a reference to the one-line refusal, listed under the table. Four tables:

* data-parallel methods (``ddp``, ``zero1``, ``acco``, ``dpu``, ``wp``) x ``comm.layout`` x
  ``comm.quantize``;
* the LoCo methods x ``loco.inner`` x ``loco.outer_overlap``;
* the pipeline x ``pipeline.data_method``;

each against ``opt.name`` (``adamw``, ``sgd``, ``lion``, ``muon``; ``adafactor`` runs through the
public API, ``acco_jax.acco(optax.adafactor(...))``, not through the config); and every family
(each method, the pipeline's schedules, SkipPipe's paths, Muon) against ``model.arch``
(``gpt2``, ``gpt_neo``, ``llama``). HDEE trains each expert as a data-parallel run of
``hdee.method`` on one device: the first table is its table.

Usage::

  python -m bench.run.compat             # writes docs/compositions.md (a few minutes on 2 cores)
  python -m bench.run.compat --check     # exit 1 if docs/compositions.md is not what the code says
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys
from pathlib import Path

from bench import common

OUT = common.REPO / "docs" / "compositions.md"
OPTIMIZERS = ("adamw", "sgd", "lion", "muon", "adafactor")
DP = ("ddp", "zero1", "acco", "dpu", "wp")
LOCO = ("diloco", "streaming_diloco", "noloco", "sparseloco", "demo")
TABLES = {
  "Data-parallel methods": [
    {"method": m, "comm.layout": lay, "comm.quantize": q}
    for m, lay, q in itertools.product(
      DP, ("auto", "elementwise", "owner"), ("none", "int8", "int4")
    )
  ],
  "Low-communication methods (4 workers x 2 devices)": [
    {"method": m, "loco.workers": 4, "loco.inner": i, "loco.outer_overlap": o}
    for m, i, o in itertools.product(LOCO, ("zero1", "ddp", "acco"), ("none", "delayed", "eager"))
  ],
  "Pipeline (2 lanes x 4 stages)": [
    {"method": "pipeline", "pipeline.data_method": d} for d in ("ddp", "zero1", "acco")
  ],
}
ARCHS = ("gpt2", "gpt_neo", "llama", "qwen2", "qwen3", "mistral")
# Each family against the architecture (model.arch), AdamW unless the row names an optimizer: the
# families see a model only through acco_jax.model's interface
ARCH_ROWS = [
  *({"method": m} for m in DP),
  *({"method": m, "loco.workers": 4} for m in LOCO),
  {"method": "diloco", "loco.workers": 4, "loco.inner": "acco"},
  {"method": "pipeline", "pipeline.schedule": "gpipe", "pipeline.data_method": "ddp"},
  {"method": "pipeline", "pipeline.schedule": "1f1b", "pipeline.data_method": "zero1"},
  {"method": "pipeline", "pipeline.schedule": "skippipe", "pipeline.data_method": "acco"},
  {"method": "acco", "pipeline.stages": 4, "model.N": 4},  # SkipPipe paths on data-parallel workers
  {"method": "acco", "opt.name": "muon"},
  {"method": "diloco", "loco.workers": 4, "opt.name": "muon"},
  {"method": "pipeline", "opt.name": "muon"},
]
ARCH_TABLE = "Architectures (model.arch)"
# The test file that trains each kind of combination (the first that matches is named); a guide to
# where a path is exercised, by what the cell sets
COVERAGE = (
  ({"model.arch": "llama"}, "arch_family_test"),
  ({"pipeline.stages": 4}, "skippipe_train_test"),
  ({"loco.inner": "acco"}, "loco_acco_test"),
  (dict(opt="muon", method="diloco"), "muloco_test"),
  (dict(opt="muon", method="noloco"), "muloco_test"),
  (dict(opt="muon", method="streaming_diloco"), "muloco_test"),
  (dict(opt="muon", method="pipeline"), "pipeline_muon_test"),
  (dict(opt="muon"), "muon_config_test"),
  ({"comm.quantize": "int8"}, "quantized_step_test"),
  ({"comm.quantize": "int4"}, "quantized_step_test"),
  ({"loco.outer_overlap": "eager"}, "loco_overlap_test"),
  ({"loco.outer_overlap": "delayed"}, "loco_overlap_test"),
  ({"method": "diloco", "loco.inner": "ddp"}, "loco_test"),
  (dict(method="pipeline"), "pipeline_train_test"),
  (dict(method="noloco"), "loco_family_test"),
  (dict(method="sparseloco"), "loco_family_test"),
  (dict(method="demo"), "loco_family_test"),
  (dict(method="diloco"), "loco_test"),
  (dict(method="streaming_diloco"), "streaming_diloco_test"),
  *((dict(method=m), "methods_test") for m in DP),
)


def config_for(cell: dict):
  """The tiny config of ``cell`` (``method``, ``opt`` and ``group.field`` values), 8 CPU devices."""
  name = "pipeline" if cell["method"] == "pipeline" else cell["method"]
  module = importlib.import_module(f"configs.gpt2_{name}")
  config = module.get_config("tiny")
  config.data.cache_dir = os.environ.get("ACCO_JAX_COMPAT_CACHE", "")
  config.opt.name = cell.get("opt", "adamw")
  for key, value in cell.items():
    if "." in key:
      group, field = key.split(".")
      config[group][field] = value
  return config


def outcome(cell: dict) -> str:
  """'runs' or the refusal ``train.py`` prints for ``cell`` (``error: ...``). The config is first
  checked alone (``build(config, check_only=True)``: no data is prepared); a refusal that comes
  only when the run is built from its data is marked ``late error: ...`` (the page must have
  none: every refusal comes before any work)."""
  from acco_jax import errors
  from acco_jax.run import build

  refusals = (errors.UserError, ValueError, TypeError, FileNotFoundError)
  config = config_for(cell)
  try:
    build.build(config, check_only=True)
  except refusals as e:
    return "error: " + str(e)
  try:
    build.build(config)
  except refusals as e:
    return "late error: " + str(e)
  return "runs"


# The rows of the architecture table that tests/arch_family_test.py trains GPT-Neo, Qwen2, Qwen3
# and Mistral in (Llama: every row)
NEO_TRAINED = [
  {"method": "acco"},
  {"method": "diloco", "loco.workers": 4, "loco.inner": "acco"},
  *(r for r in ARCH_ROWS if r["method"] == "pipeline" or "pipeline.stages" in r),
]


def covered_by(cell: dict) -> str | None:
  if cell.get("model.arch") in ("gpt_neo", "qwen2", "qwen3", "mistral"):
    row = {k: v for k, v in cell.items() if k != "model.arch"}
    return "arch_family_test" if row in NEO_TRAINED else None
  cell = {**cell, "opt": cell.get("opt", cell.get("opt.name", "adamw"))}
  for want, test in COVERAGE:
    if all(cell.get(k) == v for k, v in want.items()):
      return test
  return None


def render(results: dict[str, dict]) -> str:
  """The markdown of ``{table: {row label: {opt: outcome}}}``."""
  lines = [
    "# What composes with what",
    "",
    "Generated by `python -m bench.run.compat` (checked by `tests/compat_test.py`; do not edit by hand).",
    "Each cell is the `tiny` preset of the method's config file on 8 simulated CPU devices with the",
    "row's and the column's values, built as `train.py` builds it: **runs** (and the test that trains",
    "the combination, where one does: `tests/<name>.py`), or **no** and the one-line refusal",
    "(numbered under the table) that `train.py` prints. `opt.name=adafactor` is not a config value:",
    "Adafactor runs through the public API (`acco_jax.acco(optax.adafactor(...))`, the owner layout",
    "chosen by `layout='auto'`; `tests/owner_step_test.py`). HDEE trains each expert as a",
    "data-parallel run of `hdee.method`: the first table is its table.",
  ]
  for title, rows in results.items():
    refusals: list[str] = []
    lines += [
      "",
      f"## {title}",
      "",
      "| " + " | ".join(["row", *OPTIMIZERS]) + " |",
      "|" + "---|" * (len(OPTIMIZERS) + 1),
    ]
    for label, by_opt in rows.items():
      cells = []
      for opt in OPTIMIZERS:
        text, test = by_opt[opt]
        if text == "runs":
          cells.append("runs" + (f" · `{test}`" if test else ""))
          continue
        if text not in refusals:
          refusals.append(text)
        cells.append(f"no ({refusals.index(text) + 1})")
      lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{i + 1}. `{text.removeprefix('error: ')}`" for i, text in enumerate(refusals)]
  return "\n".join(lines) + "\n"


def render_archs(by_row: dict[str, dict]) -> str:
  """The markdown of ``{row label: {arch: outcome}}``."""
  lines = [
    f"## {ARCH_TABLE}",
    "",
    "Each family against the architecture: the families see a model only through",
    "`acco_jax.model`'s interface (`acco_jax/models/`), so every cell runs. `tests/arch_family_test.py`",
    "trains Llama in every row and GPT-Neo, Qwen2, Qwen3 and Mistral in the rows it names (one",
    "method of each family by default, where local blocks and sliding windows meet the pipeline",
    "and SkipPipe's traced orders when marked slow); their other cells are built, not trained.",
    "",
    "| " + " | ".join(["row", *ARCHS]) + " |",
    "|" + "---|" * (len(ARCHS) + 1),
  ]
  refusals: list[str] = []
  for label, by_arch in by_row.items():
    cells = []
    for arch in ARCHS:
      text, test = by_arch[arch]
      if text == "runs":
        cells.append("runs" + (f" · `{test}`" if test else ""))
        continue
      if text not in refusals:
        refusals.append(text)
      cells.append(f"no ({refusals.index(text) + 1})")
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  lines.append("")
  lines += [f"{i + 1}. `{text.removeprefix('error: ')}`" for i, text in enumerate(refusals)]
  return "\n".join(lines) + "\n"


def label_of(row: dict) -> str:
  hidden = ("loco.workers", "model.arch", "model.N")
  return ", ".join(f"{k}={v}" for k, v in row.items() if k not in hidden)


def collect(progress=None) -> dict:
  results: dict = {}
  for title, rows in TABLES.items():
    for row in rows:
      by_opt = {}
      for opt in OPTIMIZERS:
        cell = {**row, "opt": opt}
        text = outcome(cell)
        by_opt[opt] = (text, covered_by(cell) if text == "runs" else None)
        if progress:
          progress(f"{label_of(cell)}: {text[:100]}")
      results.setdefault(title, {})[label_of(row)] = by_opt
  for row in ARCH_ROWS:
    by_arch = {}
    for arch in ARCHS:
      cell = {**row, "model.arch": arch}
      text = outcome(cell)
      by_arch[arch] = (text, covered_by(cell) if text == "runs" else None)
      if progress:
        progress(f"{label_of(cell)}: {text[:100]}")
    results.setdefault(ARCH_TABLE, {})[label_of(row)] = by_arch
  return results


def render_all(results: dict) -> str:
  tables = {k: v for k, v in results.items() if k != ARCH_TABLE}
  return render(tables) + "\n" + render_archs(results[ARCH_TABLE])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--check", action="store_true", help="compare with docs/compositions.md")
  p.add_argument("--out", type=Path, default=OUT)
  args = p.parse_args(argv)
  from acco_jax import parallel

  parallel.configure_platform(cpu_devices=8)
  text = render_all(collect(None if args.check else common.log))
  if args.check:
    same = args.out.exists() and args.out.read_text() == text
    print("docs/compositions.md is current" if same else "docs/compositions.md is out of date")
    return 0 if same else 1
  args.out.write_text(text)
  common.log(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main())
