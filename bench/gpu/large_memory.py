"""Do the large presets fit? Per-device memory of GPT-Neo 2.7B and a ~1B Llama under acco and zero1
on 8 x H100, compiled for an abstract topology (compile only: the CUDA PJRT plugin, no GPU).

For each preset and method, the stage program (:func:`bench.common.abstract_stage`: the model's
parameters and the train state as shapes, nothing allocated) is compiled by XLA:GPU for an abstract
``--devices`` x ``--target`` topology (:func:`acco_jax.parallel.gpu_aot_devices`) with
:data:`acco_jax.parallel.GPU_OVERLAP_FLAGS`, bf16 compute, every block rematerialised
(``remat=True``) and the vocabulary padded to 128. Reported per device, from
``compiled.memory_analysis()``: arguments (the state and the batch), temporaries, and the program's
total (arguments + outputs − aliased + temporaries), against the device's 80 GB and beside the state
this layout's formula predicts (docs/benchmarks/dp.md, "Core: memory": ZeRO-1 ``(2 + 12/N) Ψ``, ACCO
``(2 + 2 + 16/N) Ψ`` bytes). Attention is XLA's (cuDNN's fused kernel does not compile without a
GPU): its scores are materialised, so the temporaries are an upper bound of a GPU run's.

The batches are the settings the presets are for: GPT-Neo 2.7B as the ACCO paper fine-tunes it
(Table 5: 4 rows of at most 512 tokens per device; ACCO 2 microbatches per stage, ZeRO-1 4 per
update), the Llama with 4 rows of 1,024 tokens. Usage::

  PYTHONPATH=. python -m bench.gpu.large_memory                 # both presets, acco and zero1
  python -m bench.gpu.large_memory --smoke --out /tmp/m.json    # tiny presets, 2 devices
  python -m bench.gpu.large_memory --smoke --presets llama-tiny --methods acco   # one (tests)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import common

GB = 1e9
# (arch, size, rows per device, tokens per row, microbatches per stage of acco / zero1)
PRESETS = {
  "gpt_neo-2.7b": ("gpt_neo", "2.7b", 4, 512, {"acco": 2, "zero1": 4}),
  "llama-1b": ("llama", "1b", 4, 1024, {"acco": 2, "zero1": 4}),
}
SMOKE = {
  "gpt_neo-tiny": ("gpt_neo", "tiny", 1, 32, {"acco": 2, "zero1": 2}),
  "llama-tiny": ("llama", "tiny", 1, 32, {"acco": 2, "zero1": 2}),
}


def state_formula(method: str, n: int) -> float:
  """Bytes per parameter per device of this layout's state (docs/benchmarks/dp.md, "Core: memory")."""
  return 2 + 2 + 16 / n if method == "acco" else 2 + 12 / n


def measure(name: str, spec, method: str, devices, target: str) -> dict:
  import optax

  import acco_jax
  from acco_jax import model

  arch, size, rows, seq, ks = spec
  cfg = model.get_config(
    size, arch=arch, dtype="bfloat16", remat=True, attention="xla", vocab_multiple=128
  )
  inner = optax.adamw(2e-5, b1=0.9, b2=0.95, weight_decay=0.0)  # the paper's fine-tuning
  tx = getattr(acco_jax, method)(inner, comm_dtype="bfloat16")
  t0 = time.time()
  fn, fargs, train = common.abstract_stage(cfg, tx, devices, ks[method], rows, seq)
  compiled = fn.lower(*fargs).compile()
  mem = compiled.memory_analysis()
  n, psi = len(devices), train.layout.num_params
  arg, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
  alias, temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
  total = arg + out - alias + temp
  return {
    "preset": name,
    "method": method,
    "devices": n,
    "target": target,
    "params": psi,
    "rows": rows,
    "seq": seq,
    "microbatches": ks[method],
    "argument_gb": arg / GB,
    "temp_gb": temp / GB,
    "total_gb": total / GB,
    "state_formula_gb": state_formula(method, n) * psi / GB,
    "of_80gb": total / (80 * GB),
    "compile_s": time.time() - t0,
  }


def table(rows: list[dict]) -> str:
  head = "| preset | method | Ψ | batch per device | state formula GB | arguments GB | temp GB | total GB | of 80 GB | compile s |"
  lines = [head, "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    batch = f"{r['microbatches']} x {r['rows']} x {r['seq']}"
    lines.append(
      f"| {r['preset']} | {r['method']} | {r['params'] / 1e9:.2f}B | {batch} | "
      f"{r['state_formula_gb']:.1f} | {r['argument_gb']:.1f} | {r['temp_gb']:.1f} | "
      f"{r['total_gb']:.1f} | {r['of_80gb']:.0%} | {r['compile_s']:.0f} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--presets", default="", help=f"default: all ({', '.join(PRESETS)})")
  p.add_argument("--methods", default="acco,zero1")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--target", default="h100", choices=("h100", "a100"))
  p.add_argument("--smoke", action="store_true", help="tiny presets on 2 devices (CI)")
  p.add_argument("--out", type=Path, default=common.RESULTS / "large_memory.json")
  args = p.parse_args(argv)
  from acco_jax import parallel

  if not parallel.has_cuda_plugin():
    common.log('skipped: needs the CUDA PJRT plugin: pip install "jax-cuda12-pjrt==<jaxlib>"')
    return 0
  parallel.configure_platform(gpu_overlap=True)
  table_of = SMOKE if args.smoke else PRESETS
  names = args.presets.split(",") if args.presets else list(table_of)
  unknown = [n for n in names if n not in table_of]
  if unknown:
    raise SystemExit(f"unknown preset(s) {unknown}: choose from {', '.join(table_of)}")
  presets = {k: table_of[k] for k in names}
  devices = parallel.gpu_aot_devices(2 if args.smoke else args.devices, args.target)
  rows = []
  for name, spec in presets.items():
    for method in args.methods.split(","):
      rows.append(measure(name, spec, method, devices, args.target))
      common.log(f"{name} {method}: {rows[-1]['total_gb']:.1f} GB per device")
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps({"rows": rows, "machine": common.machine()}, indent=2))
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
