"""A run's peak memory, predicted from shapes before any work, and a refusal of what does not fit.

Per device: the train state (its shards, from the family's abstract state: parameters, optimizer
state, ACCO's buffers), the step program's temporaries (:data:`STEP_PARAM_COPIES` float32 copies
of the parameters, as XLA's buffer assignment reports them) and one microbatch's activations
(``B L (c_D D + c_F F) + B H L^2`` per block unless rematerialised, and the logits ``B L V``). On
the host: the runtime, the compiled programs and the rest (:data:`REST_PARAM_COPIES`), and on a CPU
every simulated device's state and temporaries (they all live in host memory), or, when larger
than the temporaries, the checkpoint save's host copy of the state (orbax copies each array to
host memory before it writes).

The constants were fitted to measured peaks (docs/benchmarks/run.md, ``python -m
bench.run.sft_memory``): the prediction is meant within a factor of 1.5 of the peak resident
memory, not exact. ``train.memory_check=False`` skips the refusal (the prediction is still
printed); ``mesh.fit_memory`` picks the simulated device count (:func:`fit_devices`).
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import jax
import numpy as np

from acco_jax import errors

GB = 1e9
RUNTIME_BYTES = 0.7e9  # python, jax, the data, the tokenizer and a small compilation
# the rest, in float32 parameters: the compiled programs, the evaluation's copy of the parameters,
# the memory-mapped checkpoint, temporaries of programs that overlap the step's and what the
# allocator keeps (train.py's SmolLM2 fine-tune on 1 CPU device peaked at 10.7 and 11.4 GB on a
# shared machine: beyond 0.7 GB of runtime, 2.69 GB of state and 3.4 GB of the step, 4 GB, 7.5x)
REST_PARAM_COPIES = 7.5
# a stage program's temporaries per device, in float32 parameters: XLA:CPU's buffer assignment of
# ACCO's stage on SmolLM2 (134.5M parameters, 1 row of 64 tokens) reports 3.19 GB of temporaries,
# 5.9x the float32 parameters (gradients, their accumulation, the optimizer's updates)
STEP_PARAM_COPIES = 6
# XLA:GPU reuses buffers more: ACCO's stage of GPT-Neo 2.7B compiled for an abstract H100 has
# 19.9 GB of temporaries, 1.9x its float32 parameters, activations of 4 x 512 tokens included
# (docs/benchmarks/gpu.md, Large presets)
STEP_PARAM_COPIES_ACCELERATOR = 2
ACT_FLOATS_D, ACT_FLOATS_F = 12, 3  # activations kept per block and token: c_D D + c_F F floats


class Prediction(NamedTuple):
  """Predicted peak bytes: ``device`` per device, ``host`` on the host; ``parts``: by cause."""

  device: float
  host: float
  parts: dict


def state_bytes(abstract_state: Any) -> tuple[float, float]:
  """``(largest per device, summed over devices)`` bytes of a state of ``jax.ShapeDtypeStruct``
  leaves with shardings (a leaf without one: on one device)."""
  per_device: dict[Any, float] = {}
  for leaf in jax.tree.leaves(abstract_state):
    sharding = getattr(leaf, "sharding", None)
    itemsize = np.dtype(leaf.dtype).itemsize
    if sharding is None:
      per_device[None] = per_device.get(None, 0.0) + math.prod(leaf.shape) * itemsize
      continue
    shard = math.prod(sharding.shard_shape(leaf.shape)) * itemsize
    for d in sharding.device_set:
      per_device[d] = per_device.get(d, 0.0) + shard
  if not per_device:
    return 0.0, 0.0
  return max(per_device.values()), sum(per_device.values())


def activation_bytes(cfg, rows: int, length: int) -> float:
  """One microbatch's activations kept for the backward pass and its logits, in bytes."""
  itemsize = np.dtype(cfg.dtype).itemsize
  f = cfg.F or 4 * cfg.D
  per_block = rows * length * (ACT_FLOATS_D * cfg.D + ACT_FLOATS_F * f) + rows * cfg.H * length**2
  blocks = 2 if cfg.remat else cfg.N  # remat keeps a block's input only (and one block's worth)
  logits = 3 * rows * length * cfg.V * 4  # float32 logits, their softmax and gradient
  return per_block * blocks * itemsize + logits


def predict(config, model_cfg, abstract_state, params_shapes, num_devices: int, cpu: bool):
  """The :class:`Prediction` of a run: ``abstract_state`` from the family's
  ``abstract_state(params_shapes)``; ``cpu``: the devices share the host's memory."""
  state_dev, state_all = state_bytes(abstract_state)
  params = sum(math.prod(x.shape) for x in jax.tree.leaves(params_shapes))
  step = (STEP_PARAM_COPIES if cpu else STEP_PARAM_COPIES_ACCELERATOR) * params * 4
  acts = activation_bytes(model_cfg, config.batch.microbatch_size, config.data.seq_len)
  # orbax copies every array (one replica of each shard) to host memory before it writes
  ckpt = sum(
    math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract_state)
  )
  rest = REST_PARAM_COPIES * params * 4
  if cpu:  # the step's temporaries are gone while the checkpoint is saved
    extra = max(num_devices * (step + acts), ckpt)
    host = RUNTIME_BYTES + rest + state_all + extra
  else:
    host = RUNTIME_BYTES + rest + ckpt
  parts = {
    "state_per_device": state_dev,
    "state_all_devices": state_all,
    "step_per_device": step,
    "activations_per_device": acts,
    "compile_and_rest": rest,
    "checkpoint_host_copy": ckpt,
  }
  return Prediction(state_dev + step + acts, host, parts)


def host_memory_bytes() -> float:
  """The machine's physical memory (``/proc/meminfo`` MemTotal, else ``os.sysconf``)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          return float(line.split()[1]) * 1024
  except OSError:
    pass
  return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_memory_bytes(device) -> float | None:
  """An accelerator's memory (``memory_stats()['bytes_limit']``), or ``None`` where the backend
  does not say."""
  try:
    stats = device.memory_stats()
  except Exception:  # backends without memory_stats raise various types
    return None
  return float(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def describe(p: Prediction, num_devices: int, cpu: bool) -> str:
  """One terminal line: the predicted peaks and their largest parts."""
  parts = p.parts
  where = f"{num_devices} simulated device(s) in host memory" if cpu else f"{num_devices} device(s)"
  return (
    f"memory (predicted): {p.device / GB:.2f} GB per device (state {parts['state_per_device'] / GB:.2f}"
    f", step {parts['step_per_device'] / GB:.2f}, activations "
    f"{parts['activations_per_device'] / GB:.2f}), host peak {p.host / GB:.2f} GB ({where}; "
    f"checkpoint copy {parts['checkpoint_host_copy'] / GB:.2f}, compiled programs and the rest {parts['compile_and_rest'] / GB:.2f})"
  )


def check(p: Prediction, config, num_devices: int, cpu: bool, host_total=None, device_total=None):
  """Raises :class:`errors.UserValueError` (one line, with the fix) where ``p`` does not fit:
  the host's physical memory (``host_total``, default the machine's) or, on an accelerator, its
  memory (``device_total``, default what the backend reports)."""
  host_total = host_memory_bytes() if host_total is None else host_total
  skip = "or pass --config.train.memory_check=False if you know better"
  if p.host > host_total:
    fix = (
      f"fewer simulated devices (--config.mesh.cpu_devices, now {num_devices}, or "
      "--config.mesh.fit_memory=True), "
      if cpu and num_devices > 1
      else ""
    )
    raise errors.UserValueError(
      f"the run needs about {p.host / GB:.1f} GB of host memory at its peak and this machine has "
      f"{host_total / GB:.1f} GB: use {fix}a smaller batch.microbatch_size (now "
      f"{config.batch.microbatch_size}) or data.seq_len, model.remat=True, {skip}"
    )
  if not cpu and device_total is not None and p.device > device_total:
    raise errors.UserValueError(
      f"the run needs about {p.device / GB:.1f} GB per device and a device has "
      f"{device_total / GB:.1f} GB: use more devices, a smaller batch.microbatch_size (now "
      f"{config.batch.microbatch_size}), model.remat=True or a 16-bit model.dtype, {skip}"
    )


def predict_run(run, config, cpu: bool) -> Prediction:
  """:func:`predict` of a built run (:class:`acco_jax.family_api.Run`, data or not), from its own
  abstract state."""
  abstract = run.step.abstract_state(run.params_shapes)
  return predict(config, run.model_cfg, abstract, run.params_shapes, run.mesh.size, cpu)


def check_run(run, config, *, lead: bool = True) -> Prediction:
  """The trainer's pre-work check of a built run (:class:`acco_jax.family_api.Run`): prints the
  prediction in one line (``lead``) and refuses, unless ``train.memory_check`` is off, a run that
  does not fit."""
  devices = run.mesh.devices.flat
  first = next(iter(devices))
  cpu = first.platform == "cpu"
  p = predict_run(run, config, cpu)
  if lead:
    print(describe(p, run.mesh.size, cpu), flush=True)
  if config.train.get("memory_check", True):
    check(p, config, run.mesh.size, cpu, device_total=None if cpu else device_memory_bytes(first))
  return p


FIT_FRACTION = 0.8  # mesh.fit_memory leaves a fifth of the machine's memory to the rest


def fit_devices(config, build_checked, *, host_total=None, lead: bool = True) -> int | None:
  """``mesh.fit_memory`` on a CPU: sets ``config.mesh.num_devices`` to the most simulated devices
  (of ``mesh.num_devices`` or all, halving) whose predicted host peak fits in :data:`FIT_FRACTION`
  of the machine's memory, and returns it; ``None`` (nothing changed) where it is off or the devices
  are not a CPU's. ``build_checked(config)``: the run built without data (``build(config,
  check_only=True)``)."""
  if not config.mesh.get("fit_memory", False) or jax.devices()[0].platform != "cpu":
    return None
  host_total = host_memory_bytes() if host_total is None else host_total
  wanted = n = config.mesh.num_devices or jax.device_count()
  while True:
    config.mesh.num_devices = n
    p = predict_run(build_checked(config), config, cpu=True)
    if p.host <= FIT_FRACTION * host_total or n == 1:
      break
    n //= 2
  if lead and n != wanted:
    print(
      f"mesh.fit_memory: {n} of {wanted} simulated devices, predicted host peak {p.host / GB:.1f} "
      f"GB of this machine's {host_total / GB:.1f} GB",
      flush=True,
    )
  return n
