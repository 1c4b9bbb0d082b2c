r"""A run's parameters as a Hugging Face directory: ``python -m acco_jax.export <workdir> <out_dir>``.

Reads the newest checkpoint of ``<workdir>`` (read-only) and writes ``<out_dir>`` with
``config.json``, the weights (``model.safetensors``, or shards and an index) and the run's
tokenizer, which ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` and
``AutoTokenizer.from_pretrained(out_dir)`` load as they are. Any run kind:

- ddp, zero1, dpu: the parameters; acco and wp: the committed θ (not ACCO's estimate θ̃ or WP's
  prediction);
- a LoCo run (diloco, ...): the global parameters θ_g, not a worker's;
- a pipeline: every stage's blocks gathered into one model;
- an HDEE recipe (``method=hdee``): every job (seed models, each expert after each iteration, the
  dense reference) into ``<out_dir>/<job>/``.

The checkpoint records the model and the tokenizer it was trained with (a trained BPE's file, a
Hugging Face directory's tokenizer; :func:`acco_jax.run.build.model_meta`) and the devices it is
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
import json
import os
import sys


def _meta_steps(checkpoints: str) -> list[tuple[int, dict]]:
  """``(step, extra)`` of every checkpoint whose metadata reads, newest first (plain JSON: read
  before JAX starts, to know the devices the state needs)."""
  out = []
  steps = sorted((int(d) for d in os.listdir(checkpoints) if d.isdigit()), reverse=True)
  for step in steps:
    path = os.path.join(checkpoints, str(step), "meta", "metadata")
    try:
      with open(path) as f:
        out.append((step, json.load(f)["extra"]))
    except (OSError, ValueError, KeyError):
      continue
  return out


def recorded(workdir: str) -> dict:
  """The ``extra`` of the newest checkpoint of the run in ``workdir`` whose metadata reads (its
  config, model, tokenizer and device count), read as plain JSON; ``{}`` if none."""
  checkpoints = os.path.join(workdir, "checkpoints")
  metas = _meta_steps(checkpoints) if os.path.isdir(checkpoints) else []
  return metas[0][1] if metas else {}


def runs_of(workdir: str) -> list[tuple[str, str]]:
  """``(name, run workdir)`` of what ``workdir`` holds: itself, or each job of an HDEE recipe."""
  from acco_jax import errors

  if not os.path.isdir(workdir):
    raise errors.UserFileNotFoundError(f"{workdir}: no such directory: give a run's workdir")
  if os.path.isfile(os.path.join(workdir, "recipe.json")):
    jobs = sorted(  # job names may hold a slash (steps/hard-1)
      os.path.relpath(root, workdir)
      for root, dirs, _ in os.walk(workdir)
      if "checkpoints" in dirs and root != workdir
    )
    if not jobs:
      raise errors.UserValueError(f"{workdir}: an HDEE recipe whose jobs hold no checkpoint yet")
    return [(job, os.path.join(workdir, job)) for job in jobs]
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise errors.UserValueError(
      f"{workdir}: holds no checkpoints/ directory: give the workdir of a run of train.py"
    )
  return [("", workdir)]


def devices_needed(workdir: str, step: int | None = None) -> int:
  """The devices the newest (or ``step``'s) checkpoint of each run in ``workdir`` is laid out over."""
  need = 1
  for _, run_dir in runs_of(workdir):
    metas = _meta_steps(os.path.join(run_dir, "checkpoints"))
    extra = next((e for s, e in metas if step is None or s == step), {})
    need = max(need, int(extra.get("num_devices", 0)) or _configured_devices(extra))
  return need


def _configured_devices(extra: dict) -> int:
  """A checkpoint without ``num_devices`` (written before it was recorded): its config's count."""
  config = json.loads(extra.get("config", "{}"))
  mesh = config.get("mesh", {})
  return int(mesh.get("num_devices") or mesh.get("cpu_devices") or 1)


def read_params(workdir: str, step: int | None = None):
  """The committed parameters of the newest (or ``step``'s) checkpoint of the run in ``workdir``
  (read-only), as float32 numpy leaves in the model's structure.

  Returns:
    ``(params, the model config, the checkpoint's extra)``: the model as the run recorded it
    (its dtype and vocabulary padding included).
  """
  import jax
  import ml_collections

  from acco_jax import errors, model
  from acco_jax.run import build as build_lib
  from acco_jax.run import registry
  from acco_jax.run.checkpoint import open_read_only

  found = {}

  def target_of(extra: dict):
    src = ml_collections.ConfigDict(json.loads(extra["config"]))
    if "model" in extra:
      cfg = model.ModelConfig(**extra["model"])
    else:  # written before the model was recorded: from its config
      cfg = build_lib.model_config(src, extra["vocab"]["V"])
    family = registry.lookup(src.method)
    if family.source_step is None:
      raise errors.UserValueError(f"{workdir}: checkpoints of method={src.method} do not export")
    n = int(extra.get("num_devices", 0)) or len(jax.devices())
    if family.name == "loco" and n > len(jax.devices()):
      raise errors.UserValueError(
        f"{workdir}: a {src.method} checkpoint is laid out over its {n} devices, this process "
        f"has {len(jax.devices())}: read it on the CPU (JAX_PLATFORMS=cpu) or a machine with as "
        "many"
      )
    n = min(n, len(jax.devices()))  # the other families read a checkpoint of any device count
    found.update(src=src, cfg=cfg, step=family.source_step(src, cfg, n))
    return found["step"].abstract_state(model.param_shapes(cfg))

  with open_read_only(os.path.join(workdir, "checkpoints")) as ckpt:
    if not ckpt.all_steps():
      raise errors.UserValueError(f"{workdir}: holds no checkpoint to read")
    saved_like = lambda shapes: getattr(found["step"], "saved_like", lambda _: None)(shapes)
    saved, extra = ckpt.restore_host(step, target_of, saved_like)
  return found["step"].export_params(saved), found["cfg"], {**extra, "source": found["src"]}


def export_run(workdir: str, out_dir: str, *, dtype: str = "float32", step: int | None = None):
  """Writes the parameters of the run in ``workdir`` (one run, not a recipe) to ``out_dir``.

  Returns:
    ``(out_dir, the model config, the step exported)``.
  """
  from acco_jax import data, errors, hf

  params, cfg, extra = read_params(workdir, step)
  name = extra.get("tokenizer") or extra["source"].data.tokenizer
  try:
    tokenizer = data.get_tokenizer(name)
  except (errors.UserError, ValueError) as e:
    raise errors.UserValueError(
      f"{workdir}: the run's tokenizer {name!r} cannot be read back ({e})"
    ) from None
  hf.save(
    out_dir,
    params,
    cfg,
    dtype=dtype,
    tokenizer=tokenizer,
    eos_id=tokenizer.eot_id,
    bos_id=tokenizer.bos_id,
  )
  return out_dir, cfg, int(extra["stage"])


def export(workdir: str, out_dir: str, *, dtype: str = "float32", step: int | None = None):
  """Exports the run in ``workdir``, or every job of an HDEE recipe into ``out_dir/<job>``;
  returns the directories written."""
  from acco_jax import errors

  runs = runs_of(workdir)
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

  try:
    _use_cpu(devices_needed(args.workdir, args.step))
    export(args.workdir, args.out_dir, dtype=args.dtype, step=args.step)
  except errors.UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
