"""What the LoCo comparison's compiled programs send, and what that costs on a cluster.

:func:`programs_worker` (a child process of :mod:`bench.loco.loco_compare` with the setting's device
count) compiles every method's programs on the CPU-scale model and reads their collectives, the bytes
a worker sends and the state per device; :func:`project` models the seconds to a number of inner
steps with GPT-2 124M on 8 workers of 8 H100 (:data:`PROJECTION`) at a bandwidth between workers.
"""

from __future__ import annotations

import json

from bench import common

# The projection to 8 x H100 per worker (docs/benchmarks/loco.md, "LoCo comparison").
PROJECTION = {
  "model": "GPT-2 124M",
  "params": 124_439_808,
  "tokens_per_gpu_step": 6 * 8 * 1024,  # the gpt2 preset: 6 microbatches of 8 x 1024 per GPU
  "gpu_tokens_per_s": 285e3,  # measured: train.py zero1 on one H100 (docs/benchmarks/gpu.md)
  "gpus_per_worker": 8,
  "workers": 8,
  "nvlink_GBps": 450.0,
  "link_efficiency": 0.8,
  "latency_intra_s": 5e-6,
  "latency_inter_s": 50e-6,
}

# ring hops of a sync (latency terms): all-reduce 2 (M-1), all-gather M-1, one pair exchange
HOPS = {
  "diloco": "ar",
  "streaming_diloco": "ar",
  "noloco": "pair",
  "sparseloco": "ag",
  "demo": "ag",
}


def project(
  label: str,
  prog: dict,
  steps: float,
  gbit: float,
  outer_overlap: str = "none",
  inner_method: str = "zero1",
) -> dict:
  """Modelled seconds to ``steps`` inner steps at ``gbit`` Gbit/s between workers.

  Data-parallel methods: :func:`acco_jax.analysis.perfmodel.step_time` on 8 nodes of 8 GPUs. LoCo methods:
  an inner step is ``inner_method`` (ZeRO-1, or ACCO: its collectives hidden behind its two halves)
  on one node of 8 GPUs (``inner_exposed_s``: what it waits for its own collectives); each sync of
  fragment ``p`` (every ``H`` steps)
  takes ``hops x latency + wire_p / bandwidth`` (``wire_p``: the accounting's bytes a worker sends,
  scaled from the CPU model to GPT-2's parameter count) and is hidden behind ``τ`` inner steps, or,
  with ``outer_overlap`` delayed or eager, behind the ``H/P`` inner steps of the phase it runs
  across (``P`` fragments; the whole ``H`` for DiLoCo and SparseLoCo).
  """
  from acco_jax.analysis import perfmodel as pm

  label = label.partition("@")[0]  # a sweep's run costs what its method costs at its H
  a = PROJECTION
  scale = a["params"] / prog["params"]  # bytes scale with the parameter count
  compute = a["tokens_per_gpu_step"] / a["gpu_tokens_per_s"]
  intra = pm.Link(a["nvlink_GBps"] * pm.GBYTE * a["link_efficiency"], a["latency_intra_s"])
  inter = pm.Link(gbit * pm.GBIT * a["link_efficiency"], a["latency_inter_s"])
  acct = prog["accounting"]
  if label in HOPS:  # the LoCo methods
    m = a["workers"]
    k = 2 if inner_method == "acco" else 1
    inner = pm.step_time(
      inner_method, _work(a, compute, k), pm.Cluster(1, a["gpus_per_worker"], intra)
    )
    hops = {"ar": 2 * (m - 1), "ag": m - 1, "pair": 1}[HOPS[label]]
    hidden = acct["overlap_steps"]
    if outer_overlap != "none":
      hidden = acct["sync_every"] // len(acct["sync_wire"])
    exposed = 0.0
    for wire in acct["sync_wire"].values():
      t = hops * inter.latency + wire * scale / inter.bandwidth
      exposed += max(0.0, t - hidden * inner.time) / acct["sync_every"]
    step_s, compute_s, inner_exposed = inner.time + exposed, inner.compute, inner.exposed
  else:
    cluster = pm.Cluster(a["workers"], a["gpus_per_worker"], intra, inter)
    st = pm.step_time(label, _work(a, compute, 2 if label == "acco" else 1), cluster)
    step_s, compute_s, exposed, inner_exposed = st.time, st.compute, st.exposed, 0.0
  return {
    "step_s": step_s,
    "exposed_s": exposed,
    "inner_exposed_s": inner_exposed,
    "time_s": steps * step_s,
    "compute_share": compute_s / step_s,
  }


def _work(a: dict, compute: float, k: int):
  from acco_jax.analysis import perfmodel as pm

  return pm.Workload(params=a["params"], microbatch_time=compute / k, microbatches=k)


# -- bytes and state from the compiled programs (child process) -----------------------------------


def _sent(c, n: int) -> float:
  """Bytes one device sends for collective ``c`` among ``n`` devices (ring algorithms)."""
  if c.kind == "collective-permute":
    return float(c.bytes)
  one = (n - 1) / n * c.bytes
  return 2 * one if c.kind == "all-reduce" else one


def _program_sent(cross: list, n: int) -> float:
  """Bytes one device sends in one run of a program whose collectives across workers are
  ``cross``: NoLoCo's sync switches between one collective-permute per matching, of which one runs."""
  permutes = [_sent(c, n) for c in cross if c.kind == "collective-permute"]
  return sum(_sent(c, n) for c in cross if c.kind != "collective-permute") + max(
    permutes, default=0
  )


def programs_worker(args) -> dict:
  """Per method: bytes each program sends per worker (HLO and accounting), state per device."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from acco_jax.analysis import hlo
  from acco_jax.dp.plan import comm_bytes_per_stage
  from acco_jax.loco.step import LocoStep
  from acco_jax.run import build
  from bench.loco import loco_compare as lc

  s = lc.setting(args.setting)
  out = {}
  for label in args.methods:
    config = lc.make_config(label, 0, args.setting)
    run = build.build(config)
    train = run.step
    shapes = run.params_shapes
    state = train.abstract_state(shapes)
    n_dev = run.mesh.size
    rows = n_dev * train.num_microbatches * s["microbatch_size"]
    batch_sharding = NamedSharding(train.mesh, P(run.batch_axis))
    batch = {
      k: jax.ShapeDtypeStruct((rows, s["seq_len"]), jnp.int32, sharding=batch_sharding)
      for k in ("inputs", "targets")
    }
    progs = {}
    if isinstance(train, LocoStep):
      m = train.num_workers
      per = train.num_devices  # devices per worker
      progs["stage"] = (train.program("stage", None, state), (state, batch))
      meth = train.method
      for p in range(len(train.parts)):
        if meth.overlap_steps:
          stacked = [batch] * meth.overlap_steps
          progs[f"window{p}"] = (train.program("window", p, state), (state, stacked))
          progs[f"apply{p}"] = (train.program("apply", p, state), (state,))
        else:
          progs[f"sync{p}"] = (train.program("sync", p, state), (state,))
      group_of = lambda i, per=per: i // per
    else:
      m, per = n_dev, 1
      kind = "delayed" if train.plan.delayed else "sync"
      progs[kind] = (train.stage_program(kind, state), (state, batch))
      group_of = lambda i: i  # every device is a worker
    found = {}
    for name, (fn, fn_args) in progs.items():
      cs = hlo.hlo_collectives(fn.lower(*fn_args).compile().as_text())
      cross = [c for c in cs if hlo.crosses(c, group_of)]
      found[name] = {
        "collectives": [f"{c.kind} {c.shape} {c.bytes}B" for c in cross],
        "sent_per_worker": per * _program_sent(cross, m),
      }
    state_bytes = {
      part: common.shard_bytes(getattr(state, part) if hasattr(state, part) else ())
      for part in ("inner", "outer", "inflight", "comp", "params", "opt_state", "buf", "w")
    }
    if isinstance(train, LocoStep):
      inner = state.inner
      split = {
        "params": common.shard_bytes((inner.params, inner.w)),
        "optimizer": common.shard_bytes(inner.opt_state) + common.shard_bytes(state.outer),
        "communication": common.shard_bytes((state.inflight, state.comp)),
      }
      per_sync = {p: train.wire_bytes(p) for p in range(len(train.parts))}
      acct = {
        "sync_wire": per_sync,
        "payload": train.payload_bytes(0),
        "density": train.density(),
        "syncs_per_step": len(train.parts) / train.method.sync_every,
        "sync_every": train.method.sync_every,
        "overlap_steps": train.method.overlap_steps,
      }
    else:
      split = {
        "params": common.shard_bytes((state.params, state.w)),
        "optimizer": common.shard_bytes(state.opt_state),
        "communication": common.shard_bytes((state.buf, state.buf_count)),
      }
      stage = comm_bytes_per_stage(train.plan, train.layout.padded_size, n_dev)
      stages = 2 if train.plan.two_stage else 1
      acct = {
        "sync_wire": {0: stage * stages},
        "payload": None,
        "density": 1.0,
        "syncs_per_step": 1.0,
        "sync_every": 1,
        "overlap_steps": 0,
      }
    del state_bytes
    out[label] = {
      "programs": found,
      "accounting": acct,
      "state_per_device": split,
      "params": train.layout.num_params,
      "workers": m,
      "devices_per_worker": per,
      "tokens_per_step": lc.tokens_per_update(s),
    }
    common.log(f"{label}: {json.dumps({k: v['sent_per_worker'] for k, v in found.items()})}")
  return out
