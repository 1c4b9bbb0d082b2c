"""A low-communication run from a config: DiLoCo, Streaming DiLoCo, NoLoCo, SparseLoCo or DeMo.

:func:`build_run` is what :func:`acco_jax.run.build.build` calls for these methods (through
:mod:`acco_jax.loco.family`): the method from the ``loco`` group (:func:`loco_method`), the workers'
``(replica, data)`` mesh and the :class:`acco_jax.loco.step.LocoStep`. Values that cannot work are
one-line :class:`acco_jax.errors.UserError` s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from acco_jax import data, errors, loco, model, optim, parallel
from acco_jax.dp import build as dp_build
from acco_jax.dp import layouts, methods
from acco_jax.dp.owner import OwnerLayout
from acco_jax.family_api import Run
from acco_jax.loco import step as loco_lib
from acco_jax.loco import store as store_lib
from acco_jax.loco import transport as transport_lib


def build_run(config, tokens: data.TokenData, model_cfg: model.ModelConfig) -> Run:
  """The :class:`acco_jax.family_api.Run` of a low-communication method."""
  if config.get("pipeline") is not None and config.pipeline.stages != 0:
    raise errors.UserValueError(
      f"pipeline.stages={config.pipeline.stages}: SkipPipe paths run with the data-parallel "
      f"methods (ddp, zero1, acco, dpu, wp), not {config.method}; set pipeline.stages=0"
    )
  mesh = parallel.make_mesh(config.mesh.num_devices)
  step = _step(config, model_cfg, mesh, lambda p, b: model.loss_fn(p, model_cfg, b))
  shapes = model.param_shapes(model_cfg)
  total, k = config.train.num_updates, int(config.batch.microbatches)
  axes = tuple(step.mesh.axis_names)
  return Run(
    mesh=step.mesh,
    tokens=tokens,
    model_cfg=model_cfg,
    params_shapes=shapes,
    step=step,
    stages_per_update=1,
    total_stages=total,
    base_microbatches=k,
    batch_axis=axes,
  )


def source_step(config, model_cfg: model.ModelConfig, num_devices: int) -> loco_lib.LocoStep:
  """The step of a LoCo run of ``config`` on this process's first ``num_devices`` devices (the
  run's own count: its workers' states do not move onto another mesh), never run: it reads that
  run's checkpoints and exports their global parameters (``python -m acco_jax.export``)."""
  mesh = parallel.make_mesh(num_devices)
  return _step(config, model_cfg, mesh, lambda p, b: 0.0, offline=True)


def _step(config, model_cfg: model.ModelConfig, mesh, loss, offline=False) -> loco_lib.LocoStep:
  """The workers' step of ``config`` over ``mesh``'s devices, with the per-microbatch ``loss``
  (``offline``: a store worker's step that only reads its checkpoints)."""
  method = _check_loco(config)
  url = transport_lib.store_url(config.loco.transport)
  workers = 1 if url else config.loco.workers or mesh.size
  mesh = loco_lib.worker_mesh(workers, list(mesh.devices.flat))
  k = int(config.batch.microbatches)
  shapes = model.param_shapes(model_cfg)
  dp_build.comm_args(config, mesh.size, shapes)  # refuses comm.quantize: LoCo syncs its own way
  layout, owned, view = _inner_layout(config, mesh.shape["data"], shapes)
  inner = optim.from_config(config, shapes, view=view)
  if config.method == "demo":  # no inner optimizer: the inner step only keeps the gradient
    clip = [optax.clip_by_global_norm(config.opt.clip_norm)] if config.opt.clip_norm > 0 else []
    inner = optax.chain(*clip, loco.keep_gradient())
  kwargs = {"layout": layout} if config.loco.inner in ("zero1", "acco") else {}
  inner_tx = methods.get_method(
    config.loco.inner, inner, comm_dtype=jnp.dtype(config.comm_dtype), **kwargs
  )
  try:
    return loco_lib.make_loco_step(
      loss,
      inner_tx,
      method,
      mesh,
      num_microbatches=k,
      params=shapes,
      has_aux=True,
      skip_nonfinite=config.train.on_nonfinite == "skip",
      owned=owned,
      elementwise=layouts.optimizer_is_elementwise(config),
      transport=_transport(config, url, offline),
    )
  except ValueError as e:  # a fragment layout the model cannot take
    raise errors.UserValueError(str(e)) from None


_OPEN: dict = {}  # the store transports this process opened, by (url, worker): one lease each


def _transport(config, url: str | None, offline: bool):
  """This worker's :class:`acco_jax.loco.transport.StoreTransport` (its store checked and its
  lease taken, once per process), an offline stand-in for a step that only reads checkpoints, or
  ``None`` on the mesh."""
  if url is None:
    return None
  c = config.loco
  if offline:
    return transport_lib.Offline(c.worker, c.workers)
  key = (url, c.worker)
  if key not in _OPEN or not _OPEN[key].held:  # a run of this process finished: a new lease
    store = store_lib.RoundStore(
      url,
      c.worker,
      process=jax.process_index(),
      grace_s=c.grace_s,
      min_workers=c.min_workers,
      lease_s=c.lease_s,
      keep_rounds=c.keep_rounds,
    )
    store.check_run(run_record(config))
    # a worker that starts with rounds decided catches up first: the others do not wait for it
    # in the round under way, only from the one after
    latest = store.latest_decided()
    store.acquire(from_round=latest + 2 if latest >= 0 else 0)
    _OPEN[key] = transport_lib.StoreTransport(store, c.worker, c.workers, c.snapshot_every)
  return _OPEN[key]


RECORDED = (
  "method",
  "model.arch",
  "model.size",
  "model.init",
  "data.seq_len",
  "batch.microbatches",
  "batch.microbatch_size",
  "train.num_updates",
  *(
    f"loco.{k}"
    for k in (
      "workers inner sync_every outer_lr outer_momentum fragments layout overlap_steps alpha "
      "quantize quantize_block topk chunk bits ef_decay ef_scale aggregate pairings "
      "pairing_seed snapshot_every"
    ).split()
  ),
)


def run_record(config) -> dict:
  """What every worker of a store run must share, recorded in the store by the first: the run
  (its data and seed) and the settings of :data:`RECORDED`."""
  run = f"data {config.data.source}, train.seed {config.train.seed}"
  return {"run": run, **{k: _value(config, k) for k in RECORDED}}


def _value(config, key: str):
  for part in key.split("."):
    config = config[part]
  return config


def _inner_layout(config, d: int, shapes):
  """(the inner step's layout over a worker's ``d`` devices, the leaves it owns whole, the view
  of the inner optimizer's masks); MuLoCo (``opt.name=muon``) needs the owner layout of a ZeRO-1
  inner step. One-line errors for what cannot run."""
  muon = config.opt.name == "muon"
  if muon and (config.method == "demo" or config.loco.inner != "zero1"):
    raise errors.UserValueError(
      f"opt.name=muon needs whole matrices: inside LoCo workers the owner layout of "
      f"loco.inner=zero1 gives them (loco.inner={config.loco.inner}, method={config.method}): set "
      "loco.inner=zero1 with method diloco, noloco or streaming_diloco"
    )
  layout = layouts.for_config(config, d, method=config.loco.inner)
  if layout != "owner":
    return layout, None, None
  owned = model.muon_mask(shapes) if muon else None
  return layout, owned, OwnerLayout(shapes, d, owned).view


def loco_method(config) -> loco.LocoMethod:
  """The low-communication method of ``config.method`` from the ``loco`` group (one-line errors)."""
  c = config.loco
  outer = loco.default_outer(c.outer_lr, c.outer_momentum)
  mode = dict(outer_overlap=c.outer_overlap)
  try:
    if config.method == "diloco":
      return loco.diloco(c.sync_every, outer, **mode)
    if config.method == "noloco":
      return loco.noloco(
        c.sync_every,
        outer_lr=c.outer_lr,
        momentum=c.outer_momentum,
        pairings=c.pairings,
        seed=c.pairing_seed,
      )
    sparse = dict(topk=c.topk, chunk=c.chunk, decay=c.ef_decay, aggregate=c.aggregate)
    if config.method == "sparseloco":
      return loco.sparseloco(
        c.sync_every, bits=c.bits, outer_lr=c.outer_lr, ef_scale=c.ef_scale, **sparse, **mode
      )
    if config.method == "demo":
      lr = optim.schedule(config.opt, config.train.num_updates)
      return loco.demo(lr, weight_decay=config.opt.weight_decay, **sparse)
    return loco.streaming_diloco(
      c.sync_every,
      c.fragments,
      layout=c.layout,
      overlap_steps=c.overlap_steps,
      alpha=c.alpha,
      quantize=c.quantize,
      block=c.quantize_block,
      outer=outer,
      **mode,
    )
  except ValueError as e:
    raise errors.UserValueError(str(e).replace("the FP4 block", "loco.quantize_block")) from None


def _check_store(config) -> None:
  """One-line errors for a store worker's settings."""
  c = config.loco
  if c.workers < 1 or not 0 <= c.worker < c.workers:
    raise errors.UserValueError(
      f"loco.worker={c.worker} with loco.workers={c.workers}: a store run's workers are "
      "numbered 0..loco.workers-1 (loco.workers: the run's worker slots, each a share of the data)"
    )
  if c.outer_overlap != "none":
    raise errors.UserValueError(
      f"loco.outer_overlap={c.outer_overlap!r} runs on the mesh only: with "
      f"loco.transport={c.transport} set loco.outer_overlap='none' (overlap_steps > 0 overlaps)"
    )
  if c.grace_s < 0 or c.lease_s <= 0 or c.min_workers < 1 or not 1 <= c.min_workers <= c.workers:
    raise errors.UserValueError(
      f"loco.grace_s={c.grace_s}, lease_s={c.lease_s}, min_workers={c.min_workers}: need "
      f"grace_s >= 0, lease_s > 0 and 1 <= min_workers <= loco.workers={c.workers}"
    )
  if c.snapshot_every < 1 or c.keep_rounds < c.snapshot_every:
    raise errors.UserValueError(
      f"loco.snapshot_every={c.snapshot_every}, keep_rounds={c.keep_rounds}: need "
      "1 <= snapshot_every <= keep_rounds (a joiner replays the rounds after a snapshot)"
    )


def _check_loco(config) -> loco.LocoMethod:
  """The config's low-communication method; one-line errors for values that cannot work."""
  c = config.loco
  if c.workers < 0:
    raise errors.UserValueError(f"loco.workers={c.workers} must be >= 0 (0 = one per device)")
  if transport_lib.store_url(c.transport) is not None:
    _check_store(config)
  if config.method != "streaming_diloco" and (c.fragments != 1 or c.overlap_steps or c.alpha):
    raise errors.UserValueError(
      f"{config.method} syncs every parameter at once (loco.fragments=1, overlap_steps=0, "
      "alpha=0); use method=streaming_diloco for fragments, overlap or alpha"
    )
  if c.outer_overlap != "none" and config.method in ("noloco", "demo"):
    raise errors.UserValueError(
      f"loco.outer_overlap={c.outer_overlap!r} applies to diloco, streaming_diloco and sparseloco, "
      f"not to {config.method}; set loco.outer_overlap='none'"
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
  if c.inner not in ("zero1", "ddp", "acco"):
    raise errors.UserValueError(f"loco.inner={c.inner!r}: choose 'zero1', 'ddp' or 'acco'")
  if c.inner == "acco" and (config.batch.microbatches < 2 or config.batch.microbatches % 2):
    raise errors.UserValueError(
      f"batch.microbatches={config.batch.microbatches}: loco.inner=acco runs an inner step as two "
      "stages (estimate, commit) of half the microbatches each: choose an even number >= 2"
    )
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
