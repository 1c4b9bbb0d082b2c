"""A run's committed parameters read back through its family (``python -m acco_jax.export`` and
``model.init=run:<workdir>``, :mod:`acco_jax.run.pretrained`): the shell's part of reading a saved
run, since it looks the family up in the registry. What the run recorded (its config, model,
tokenizer and device count) is :mod:`acco_jax.ckpt.meta`'s; the imports are lazy, so that the
metadata is read before JAX starts.
"""

from __future__ import annotations

import json
import os

from acco_jax import errors


def read_params(workdir: str, step: int | None = None):
  """The committed parameters of the newest (or ``step``'s) checkpoint of the run in ``workdir``
  (read-only), as float32 numpy leaves in the model's structure.

  Returns:
    ``(params, the model config, the checkpoint's extra)``: the model as the run recorded it
    (its dtype and vocabulary padding included).
  """
  import jax
  import ml_collections

  from acco_jax import model
  from acco_jax.ckpt.checkpoint import open_read_only
  from acco_jax.run import presets, registry

  found = {}

  def target_of(extra: dict):
    src = ml_collections.ConfigDict(json.loads(extra["config"]))
    if "model" in extra:
      cfg = model.ModelConfig(**extra["model"])
    else:  # written before the model was recorded: from its config
      cfg = presets.named(src, extra["vocab"]["V"], **presets.settings(src))
    family = registry.lookup(src.method)
    if family.source_step is None:
      raise errors.UserValueError(f"{workdir}: checkpoints of method={src.method} do not export")
    n = int(extra.get("num_devices", 0)) or len(jax.devices())
    if not family.reads_any_device_count and n > len(jax.devices()):
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
    saved, extra = ckpt.restore_host(
      step, target_of, lambda shapes: found["step"].saved_like(shapes)
    )
  return found["step"].export_params(saved), found["cfg"], {**extra, "source": found["src"]}
