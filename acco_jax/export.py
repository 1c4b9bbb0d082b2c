r"""A run's parameters as a Hugging Face directory: ``python -m acco_jax.export <workdir> <out_dir>``.

Reads the newest checkpoint of ``<workdir>`` (read-only) and writes ``<out_dir>`` with
``config.json``, ``generation_config.json`` (its end-of-turn ids: a chat template's ``<|im_end|>``
beside the end-of-text), the weights (``model.safetensors``, or shards and an index) and the run's
tokenizer (with its chat template and special tokens), which ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` and
``AutoTokenizer.from_pretrained(out_dir)`` load as they are. Any run kind:

- ddp, zero1, dpu: the parameters; acco and wp: the committed θ (not ACCO's estimate θ̃ or WP's
  prediction);
- a LoCo run (diloco, ...): the global parameters θ_g, not a worker's;
- a pipeline: every stage's blocks gathered into one model;
- an HDEE recipe (``method=hdee``): every job (seed models, each expert after each iteration, the
  dense reference) into ``<out_dir>/<job>/``.

The checkpoint records the model and the tokenizer it was trained with (a trained BPE's file, a
Hugging Face directory's tokenizer; :func:`acco_jax.ckpt.meta.model_meta`) and the devices it is
laid out over; the export runs on the CPU with that many simulated devices (set ``JAX_PLATFORMS``
to run it elsewhere). Nothing is written to ``<workdir>``, and ``<out_dir>`` appears whole or not
at all.

Evaluate the result with lm-evaluation-harness:
``lm_eval --model hf --model_args pretrained=<out_dir>,dtype=float32 --tasks hellaswag``.

Usage::

  python -m acco_jax.export runs/acco runs/acco-hf                # float32 weights
  python -m acco_jax.export runs/acco runs/acco-hf --dtype bfloat16 --step 100
"""

from __future__ import annotations

import argparse
import os
import sys


def export_run(workdir: str, out_dir: str, *, dtype: str = "float32", step: int | None = None):
  """Writes the parameters of the run in ``workdir`` (one run, not a recipe) to ``out_dir``.

  Returns:
    ``(out_dir, the model config, the step exported)``.
  """
  from acco_jax import data, errors, hf
  from acco_jax.data import examples
  from acco_jax.run import saved

  params, cfg, extra = saved.read_params(workdir, step)
  name = extra.get("tokenizer") or extra["source"].data.tokenizer
  try:
    tokenizer = data.get_tokenizer(name)
  except (errors.UserError, ValueError) as e:
    raise errors.UserValueError(
      f"{workdir}: the run's tokenizer {name!r} cannot be read back ({e})"
    ) from None
  init = str(extra["source"].model.get("init", "") or "")
  source_dir = init[3:] if init.startswith("hf:") and hf.is_hf_dir(init[3:]) else None
  hf.save(
    out_dir,
    params,
    cfg,
    dtype=dtype,
    tokenizer=tokenizer,
    eos_id=tokenizer.eot_id,
    bos_id=tokenizer.bos_id,
    stop_ids=examples.turn_end_ids(tokenizer),
    source_dir=source_dir,
  )
  return out_dir, cfg, int(extra["stage"])


def export(workdir: str, out_dir: str, *, dtype: str = "float32", step: int | None = None):
  """Exports the run in ``workdir``, or every job of an HDEE recipe into ``out_dir/<job>``;
  returns the directories written."""
  from acco_jax import errors
  from acco_jax.ckpt import meta

  runs = meta.runs_of(workdir)
  targets = [os.path.join(out_dir, name) if name else out_dir for name, _ in runs]
  for t in targets:
    if os.path.exists(t) and (not os.path.isdir(t) or os.listdir(t)):
      raise errors.UserValueError(
        f"{t} exists and is not empty: give a new directory (nothing was written)"
      )
  written = []
  for (_, run_dir), target in zip(runs, targets, strict=True):
    _, cfg, stage = export_run(run_dir, target, dtype=dtype, step=step)
    print(f"exported {run_dir} (stage {stage}, {cfg.arch}, N={cfg.N} D={cfg.D}) to {target}")
    written.append(target)
  return written


def _use_cpu(num_devices: int) -> None:
  """Runs this process on the CPU with ``num_devices`` simulated devices, unless told otherwise
  (before JAX starts its backend)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num_devices}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m acco_jax.export", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("workdir", help="a run's workdir (train.py --workdir), or an HDEE recipe's")
  parser.add_argument("out_dir", help="the Hugging Face directory to write (new or empty)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--step", type=int, default=None, help="a checkpoint step (default: newest)")
  args = parser.parse_args(argv)
  from acco_jax import errors
  from acco_jax.ckpt import meta

  try:
    _use_cpu(meta.devices_needed(args.workdir, args.step))
    export(args.workdir, args.out_dir, dtype=args.dtype, step=args.step)
  except errors.UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
