"""From a config to the objects a run needs: mesh, tokens, model, method and compiled step.

:func:`build` is the one place that reads the config's method choice. ACCO and its baselines get an
:class:`acco_jax.dp.step.TrainStep` over a ``data`` mesh; the low-communication methods get an
:class:`acco_jax.loco.step.LocoStep` over a ``(replica, data)`` mesh. Every value that cannot work
is refused here, before anything is written, with a one-line :class:`acco_jax.errors.UserError`.
"""

from __future__ import annotations

import os
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from acco_jax import data, errors, loco, model
from acco_jax.dp import hetero, methods, quantize
from acco_jax.dp.flat import FlatLayout
from acco_jax.dp.step import make_train_step
from acco_jax.loco import step as loco_lib
from acco_jax.pipeline import orders as pipeline_orders
from acco_jax.run import health, optim, parallel


class Run(NamedTuple):
  """Everything built from the config before the loop starts."""

  mesh: Any
  tokens: data.TokenData
  model_cfg: model.GPTConfig
  params_shapes: Any  # ShapeDtypeStruct tree of the model's parameters
  train: Any  # acco_jax.dp.step.TrainStep
  stages_per_update: int
  total_stages: int
  base_microbatches: int  # per device per stage without heterogeneous budgets
  budgets: np.ndarray | None  # fixed per-device budgets per stage (hetero.budgets), else None
  batch_axis: Any = parallel.DATA  # the mesh axes a batch's rows are sharded over
  loco: bool = False  # a low-communication method (train is an acco_jax.loco.step.LocoStep)
  orders: Any = None  # SkipPipe paths: acco_jax.pipeline.orders.LayerOrders (pipeline.stages > 0)


def _model_config(config, vocab_size: int) -> model.GPTConfig:
  overrides = {k: config.model[k] for k in ("D", "N", "H", "F") if config.model[k]}
  return model.get_config(
    config.model.size, V=vocab_size, L=config.data.seq_len, dtype=config.model.dtype,
    remat=config.model.remat, attention=config.model.attention,
    vocab_multiple=config.model.get("vocab_multiple", 1), **overrides,
  )  # fmt: skip


def prepare_tokens(config) -> data.TokenData:
  """The config's corpus, tokenized, split and cached (``data.prepare``)."""
  cache = config.data.cache_dir or os.path.expanduser("~/.cache/acco_jax")
  return data.prepare(
    config.data.source, config.data.tokenizer, cache_dir=cache,
    eval_fraction=config.data.eval_fraction, seed=config.data.split_seed,
    data_dir=config.data.data_dir or None, text_key=config.data.text_key,
  )  # fmt: skip


def batch_stream(run: Run, config, tokens, rows: int, *, seed: int, shuffle=True, epochs=None):
  """Batches of ``rows`` rows of ``tokens`` (this process's share), as the config packs them."""
  return data.batches(
    tokens, seq_len=config.data.seq_len, global_batch_rows=rows, seed=seed,
    process_index=jax.process_index(), process_count=jax.process_count(),
    shuffle=shuffle, num_epochs=epochs,
  )  # fmt: skip


def stage_plan(config) -> tuple[int, int, int]:
  """(microbatches per stage, stages per update, total stages) for the method in ``config``."""
  k = int(config.batch.microbatches)
  if config.method == "acco":
    if k < 2 or k % 2:
      raise errors.UserValueError(
        f"batch.microbatches={k}: ACCO splits an update into two stages of equal size, so it "
        "must be an even number >= 2"
      )
    return k // 2, 2, 2 * config.train.num_updates
  warmup = int(config.dpu_warmup_updates) if config.method == "dpu" else 0
  return k, 1, config.train.num_updates + (1 if warmup else 0)  # dpu: one fill stage after warm-up


def updates_done(config, stage: int) -> int:
  """Optimizer updates completed after ``stage`` stages."""
  if config.method == "acco":
    return stage // 2
  warmup = int(config.dpu_warmup_updates) if config.method == "dpu" else 0
  return stage - 1 if warmup and stage > warmup else stage


def build(config) -> Run:
  if config.method == "pipeline":  # blocks sharded over a 'stage' axis (acco_jax.pipeline)
    from acco_jax.pipeline import train as pipeline_train

    _check_config(config)
    return pipeline_train.build_run(config)
  if config.method not in methods.METHODS + loco.METHODS:
    raise errors.UserValueError(
      f"method={config.method!r} is unknown: choose one of "
      f"{', '.join(methods.METHODS + loco.METHODS)}"
    )
  _check_config(config)
  health.check_config(config)
  is_loco = config.method in loco.METHODS
  skippipe = config.get("pipeline") is not None and config.pipeline.stages != 0
  if skippipe and is_loco:
    raise errors.UserValueError(
      f"pipeline.stages={config.pipeline.stages}: SkipPipe paths run with the data-parallel "
      f"methods (ddp, zero1, acco, dpu, wp), not {config.method}; set pipeline.stages=0"
    )
  method = _check_loco(config) if is_loco else None
  mesh = parallel.make_mesh(config.mesh.num_devices)
  if is_loco:
    mesh = loco_lib.worker_mesh(config.loco.workers or mesh.size, list(mesh.devices.flat))
  tokens = prepare_tokens(config)
  model_cfg = _model_config(config, tokens.tokenizer.vocab_size)
  k, per_update, total = stage_plan(config)
  shapes = jax.eval_shape(lambda: model.init_params(model_cfg, 0))
  if config.opt.decay not in ("matrices", "all"):
    raise errors.UserValueError(f"opt.decay={config.opt.decay!r}: choose 'matrices' or 'all'")
  mask = model.decay_mask(shapes) if config.opt.decay == "matrices" else None
  inner = optim.inner_optimizer(config.opt, config.train.num_updates, mask)
  if config.method == "demo":  # no inner optimizer: the inner step only keeps the gradient
    clip = [optax.clip_by_global_norm(config.opt.clip_norm)] if config.opt.clip_norm > 0 else []
    inner = optax.chain(*clip, loco.keep_gradient())
  comm = _comm(config, mesh.size, shapes)
  if is_loco:
    return _build_loco(config, method, mesh, tokens, model_cfg, shapes, inner, k)
  kwargs = {"comm_dtype": jnp.dtype(config.comm_dtype), **comm}
  if config.method == "dpu":
    kwargs["warmup_steps"] = int(config.dpu_warmup_updates)
  tx = methods.get_method(config.method, inner, **kwargs)
  loss = lambda p, b: model.loss_fn(p, model_cfg, b)
  budgets, k_max = _budgets(config, mesh.size, k)
  orders = None
  if skippipe:  # a layer order per microbatch, in the batch (acco_jax.pipeline.orders)
    orders = pipeline_orders.LayerOrders(
      config.pipeline, model_cfg, mesh.size * k_max, config.batch.microbatch_size
    )
    loss = pipeline_orders.ordered_loss(model_cfg)
  if config.hetero.slowdown:
    delays = hetero.parse_slowdown(config.hetero.slowdown, mesh.size)
    loss = hetero.slowed(loss, delays, tx.plan.axis_name)
  train = make_train_step(
    loss, tx, mesh, num_microbatches=k_max, params=shapes, has_aux=True,
    skip_nonfinite=config.train.on_nonfinite == "skip",
  )  # fmt: skip
  return Run(mesh, tokens, model_cfg, shapes, train, per_update, total, k, budgets, orders=orders)


def _comm(config, n: int, shapes) -> dict:
  """The method's quantization arguments from the ``comm`` group (none for ``comm.quantize=none``);
  one-line errors for values that cannot work."""
  c = config.get("comm")
  if c is None or c.quantize == "none":
    return {}
  if config.method not in ("acco", "zero1"):
    raise errors.UserValueError(
      f"comm.quantize={c.quantize!r} applies to method acco or zero1, not {config.method}; set "
      "comm.quantize=none"
    )
  size = c.node_size or (jax.local_device_count() if jax.process_count() > 1 else 1)
  out = dict(quantize=c.quantize, block=c.block, error_feedback=c.error_feedback, node_size=size)
  try:
    quantize.check(**out)
    plan = methods.CommPlan(config.method, **out)
    quantize.check_plan(plan, n, FlatLayout(shapes, n).shard_size)
  except ValueError as e:  # name the config keys
    message = re.sub(r"\b(quantize|block|error_feedback|node_size)=", r"comm.\1=", str(e))
    raise errors.UserValueError(message) from None
  return out


def loco_method(config) -> loco.LocoMethod:
  """The low-communication method of ``config.method`` from the ``loco`` group (one-line errors)."""
  c = config.loco
  outer = loco.default_outer(c.outer_lr, c.outer_momentum)
  try:
    if config.method == "diloco":
      return loco.diloco(c.sync_every, outer)
    if config.method == "noloco":
      return loco.noloco(
        c.sync_every, outer_lr=c.outer_lr, momentum=c.outer_momentum, pairings=c.pairings,
        seed=c.pairing_seed,
      )  # fmt: skip
    sparse = dict(topk=c.topk, chunk=c.chunk, decay=c.ef_decay, aggregate=c.aggregate)
    if config.method == "sparseloco":
      return loco.sparseloco(
        c.sync_every, bits=c.bits, outer_lr=c.outer_lr, ef_scale=c.ef_scale, **sparse
      )
    if config.method == "demo":
      lr = optim.schedule(config.opt, config.train.num_updates)
      return loco.demo(lr, weight_decay=config.opt.weight_decay, **sparse)
    return loco.streaming_diloco(
      c.sync_every, c.fragments, layout=c.layout, overlap_steps=c.overlap_steps, alpha=c.alpha,
      quantize=c.quantize, block=c.quantize_block, outer=outer,
    )  # fmt: skip
  except ValueError as e:
    raise errors.UserValueError(str(e).replace("the FP4 block", "loco.quantize_block")) from None


def _check_loco(config) -> loco.LocoMethod:
  """The config's low-communication method; one-line errors for values that cannot work."""
  c = config.loco
  if c.workers < 0:
    raise errors.UserValueError(f"loco.workers={c.workers} must be >= 0 (0 = one per device)")
  if config.method != "streaming_diloco" and (c.fragments != 1 or c.overlap_steps or c.alpha):
    raise errors.UserValueError(
      f"{config.method} syncs every parameter at once (loco.fragments=1, overlap_steps=0, "
      "alpha=0); use method=streaming_diloco for fragments, overlap or alpha"
    )
  if config.method == "demo" and c.sync_every != 1:
    raise errors.UserValueError(
      f"demo updates every step: loco.sync_every={c.sync_every} must be 1"
    )
  if config.hetero.budgets or config.hetero.adaptive or config.hetero.slowdown:
    raise errors.UserValueError(
      f"hetero.* (per-worker microbatch budgets) applies to ACCO and its baselines, not to "
      f"method={config.method}; set hetero.budgets, hetero.adaptive and hetero.slowdown to ''"
    )
  if c.inner not in ("zero1", "ddp"):
    raise errors.UserValueError(f"loco.inner={c.inner!r}: choose 'zero1' or 'ddp'")
  if c.outer_lr <= 0 or not 0 <= c.outer_momentum < 1:
    raise errors.UserValueError(
      f"loco.outer_lr={c.outer_lr} must be > 0 and loco.outer_momentum={c.outer_momentum} in [0, 1)"
    )
  if config.method == "sparseloco" and c.outer_momentum:
    raise errors.UserValueError(
      f"loco.outer_momentum={c.outer_momentum}: sparseloco's outer step is plain SGD (its error "
      "feedback replaces the momentum); set loco.outer_momentum=0"
    )
  return loco_method(config)


def _build_loco(config, method, mesh, tokens, model_cfg, shapes, inner, k) -> Run:
  inner_tx = methods.get_method(config.loco.inner, inner, comm_dtype=jnp.dtype(config.comm_dtype))
  loss = lambda p, b: model.loss_fn(p, model_cfg, b)
  try:
    train = loco_lib.make_loco_step(
      loss, inner_tx, method, mesh, num_microbatches=k, params=shapes, has_aux=True,
      skip_nonfinite=config.train.on_nonfinite == "skip",
    )  # fmt: skip
  except ValueError as e:  # a fragment layout the model cannot take
    raise errors.UserValueError(str(e)) from None
  total = config.train.num_updates
  axes = tuple(mesh.axis_names)
  return Run(mesh, tokens, model_cfg, shapes, train, 1, total, k, None, axes, True)


_AT_LEAST = {
  "batch.microbatches": 1, "batch.microbatch_size": 1, "train.num_updates": 1,
  "train.log_every": 1, "train.eval_every": 0, "train.eval_batches": 1, "ckpt.every": 0,
  "ckpt.keep": 1,
}  # fmt: skip


# Every dtype field of the config and the values it takes (floating types the step computes in).
_DTYPES = {
  "model.dtype": ("bfloat16", "float32", "float16"),
  "comm_dtype": ("bfloat16", "float32", "float16"),
}


def _check_config(config) -> None:
  """Refuses out-of-range sizes and counts before anything is built (one line naming the key)."""
  for key, low in _AT_LEAST.items():
    group, field = key.split(".")
    value = config[group][field]
    if not isinstance(value, int) or value < low:
      raise errors.UserValueError(f"{key}={value!r} must be >= {low} (an integer)")
  if config.train.on_nonfinite not in ("stop", "skip"):
    raise errors.UserValueError(
      f"train.on_nonfinite={config.train.on_nonfinite!r}: choose 'stop' or 'skip'"
    )
  for key, allowed in _DTYPES.items():
    value = config[key.split(".")[0]][key.split(".")[1]] if "." in key else config[key]
    if value not in allowed:
      raise errors.UserValueError(
        f"{key}={value!r} is not a dtype this field takes: choose one of {', '.join(allowed)}"
      )


def _budgets(config, n: int, k: int) -> tuple[np.ndarray | None, int]:
  """(fixed per-device budgets or None, the step's block of microbatches per device)."""
  h = config.hetero
  if h.budgets and h.adaptive:
    raise errors.UserValueError(
      "hetero.budgets and hetero.adaptive are exclusive: set one of them to ''"
    )
  if h.budgets:
    budgets = hetero.parse_budgets(h.budgets, n)
    return budgets, int(budgets.max())
  if h.adaptive:
    if h.adaptive not in hetero.POLICIES:
      raise errors.UserValueError(
        f"hetero.adaptive={h.adaptive!r}: choose one of {', '.join(hetero.POLICIES)} (or '')"
      )
    k_max = int(h.max_microbatches) or 4 * k
    if k_max < k or h.adapt_every < 1:
      raise errors.UserValueError(
        f"hetero.max_microbatches={k_max} must be >= the base budget {k} per stage and "
        f"hetero.adapt_every={h.adapt_every} >= 1"
      )
    return None, k_max
  return None, k


def vocab_meta(cfg: model.GPTConfig) -> dict:
  return {"V": cfg.V, "padded": cfg.padded_vocab, "multiple": cfg.vocab_multiple}


def check_vocab(extra: dict, cfg: model.GPTConfig) -> None:
  """Refuses a checkpoint whose embedding padding differs from the config's, before reading it.

  Checkpoints written before the padding was recorded carry no ``vocab`` entry and restore as
  long as their shapes match.
  """
  saved, now = extra.get("vocab"), vocab_meta(cfg)
  if saved is None or saved == now:
    return
  if saved["V"] != now["V"]:
    raise errors.UserValueError(
      f"the checkpoint's model has a vocabulary of V={saved['V']} ids, this config's tokenizer "
      f"gives V={now['V']}: resume with the data.tokenizer it was written with, or start in a "
      "new workdir"
    )
  raise errors.UserValueError(
    f"the checkpoint holds V={saved['V']} padded to {saved['padded']} rows "
    f"(model.vocab_multiple={saved['multiple']}), this config V={now['V']} padded to "
    f"{now['padded']} (model.vocab_multiple={now['multiple']}): set "
    f"--config.model.vocab_multiple={saved['multiple']} to resume, or start in a new workdir"
  )


def comm_meta(config, train) -> dict:
  """What a checkpoint records of the communication format (read back by :func:`check_comm`)."""
  return {
    "quantize": config.comm.quantize,
    "error_feedback": bool(config.comm.error_feedback),
    "residual": bool(getattr(train, "keeps_residual", False)),
  }


def check_comm(extra: dict, config, train) -> None:
  """Refuses a checkpoint whose ZeRO-1 residual of quantized sends the config would drop or lack.

  Another ``comm.quantize`` is otherwise fine to resume with: ACCO's residual rides in its
  gradient buffer, and the compute weights are resent whole (bf16) or as updates against the
  weights every device holds (int8, int4). Checkpoints without the record restore as long as
  their leaves match.
  """
  saved, now = extra.get("comm"), comm_meta(config, train)
  if saved is None or saved["residual"] == now["residual"]:
    return
  was = f"comm.quantize={saved['quantize']}, comm.error_feedback={saved['error_feedback']}"
  if saved["residual"]:
    raise errors.UserValueError(
      f"the checkpoint holds the undelivered residual of ZeRO-1's quantized sends ({was}), "
      f"which comm.quantize={now['quantize']}, comm.error_feedback={now['error_feedback']} would "
      f"drop: resume with --config.comm.quantize={saved['quantize']} "
      "--config.comm.error_feedback=True, or start in a new workdir"
    )
  raise errors.UserValueError(
    f"the checkpoint was written without a residual of quantized sends ({was}), this config "
    f"keeps one (comm.quantize={now['quantize']} with error feedback): resume with "
    f"--config.comm.quantize={saved['quantize']} or --config.comm.error_feedback=False, or "
    "start in a new workdir"
  )
