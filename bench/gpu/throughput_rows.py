"""The rows of ``bench/gpu/gpu_throughput.py``: their names, the shapes, and how each row is
measured in this process (:func:`run_row`; what each row measures: that script's docstring)."""

from __future__ import annotations

import collections
import json
import tempfile
import time
from pathlib import Path

from bench import common

ROWS = (
  "trainer:zero1",
  "trainer:ddp",
  "trainer:acco",
  "step:zero1",
  "step:acco",
  "fwdbwd:V50257",
  "fwdbwd:V50304",
  "fwdbwd:xla",
  "adamw",
  "torch:V50257",
  "torch:V50304",
  "hlo:zero1",
  "hlo:acco",
)
SMOKE_ROWS = (
  "trainer:zero1",
  "trainer:acco",
  "step:zero1",
  "step:acco",
  "fwdbwd:V1000",
  "fwdbwd:V1024",
  "fwdbwd:xla",
  "adamw",
  "torch:V1000",
  "hlo:zero1",
)


def shapes(args) -> dict:
  """The model and batch: GPT-2 124M at the gpt2 preset, or a tiny one with ``--smoke``."""
  if args.smoke:
    return dict(size="tiny", V=1000, L=32, D=64, H=4, N=2, B=2, k=2, multiple=128)
  return dict(size="gpt2", V=50257, L=1024, D=768, H=12, N=12, B=8, k=6, multiple=128)


def _model_cfg(s: dict, *, padded=True, attention="auto"):
  from acco_jax import model

  return model.get_config(
    s["size"],
    V=s["V"],
    L=s["L"],
    D=s["D"],
    H=s["H"],
    N=s["N"],
    attention=attention,
    vocab_multiple=s["multiple"] if padded else 1,
  )


def _peak_bytes():
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def _timed(fn, steps: int, warmup: int) -> float:
  """Seconds per call of ``fn`` (returns arrays) after ``warmup`` calls."""
  import jax

  for _ in range(warmup):
    jax.block_until_ready(fn())
  start = time.perf_counter()
  for _ in range(steps):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps


def _inner_optimizer():
  import optax

  return optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
  )


def run_step(method: str, s: dict, args) -> dict:
  import jax
  import numpy as np

  import acco_jax
  from acco_jax import model, parallel

  cfg = _model_cfg(s)
  k = s["k"] // 2 if method == "acco" else s["k"]  # ACCO: an update is two stages of k/2
  mesh = parallel.make_mesh(1)
  params = model.init_params(cfg, 0)
  tx = getattr(acco_jax, method)(_inner_optimizer())
  loss = lambda p, b: model.loss_fn(p, cfg, b)
  train = acco_jax.make_train_step(loss, tx, mesh, num_microbatches=k, params=params, has_aux=True)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.V, size=(k * s["B"], s["L"] + 1), dtype=np.int32)
  batch = parallel.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
  state = train.init(params, jax.tree.map(lambda x: x[: s["B"]], batch))
  box = {"state": state}

  def one():
    box["state"], m = train.step(box["state"], batch)
    return m["loss"]

  stages = 2 if method == "acco" else 1
  seconds = _timed(one, args.steps * stages, args.warmup * stages) * stages  # per update
  out = {"seconds_per_update": seconds, "tokens_per_update": s["k"] * s["B"] * s["L"]}
  if args.profile:  # beside the JSON: <out>_step_<method>.trace.json.gz
    from bench.gpu import profile_table

    keep = Path(args.out).with_suffix("").as_posix() + f"_step_{method}.trace.json.gz"
    out["profile"] = profile_table.trace_calls(one, keep)
  return out


def run_trainer(method: str, s: dict, args) -> dict:
  from acco_jax import data, model
  from acco_jax.run import trainer
  from configs import common

  config = common.get_base("gpt2", method)
  if args.smoke:
    config.model.size, config.model.D, config.model.N, config.model.H = (
      "tiny",
      s["D"],
      s["N"],
      s["H"],
    )
    config.data.tokenizer, config.mesh.cpu_devices = "byte", 0
  config.data.seq_len = s["L"]
  config.batch.microbatch_size, config.batch.microbatches = s["B"], s["k"]
  config.mesh.num_devices = 1
  config.train.num_updates = args.warmup + args.steps
  config.opt.warmup_updates = 0  # the schedule does not change the speed
  config.train.log_every = 1
  config.train.eval_every, config.train.eval_batches, config.train.sample_tokens = 0, 1, 0
  config.ckpt.every, config.ckpt.async_save = 0, True
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train_and_evaluate(config, workdir)
    rows = [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  rows = [r for r in rows if "loss" in r and "tokens_per_s" in r and r["update"] >= args.warmup]
  first, last = rows[0], rows[-1]
  seconds = (last["wall_s"] - first["wall_s"]) / max(last["update"] - first["update"], 1)
  tokens = (last["tokens_seen"] - first["tokens_seen"]) / max(last["update"] - first["update"], 1)
  V = data.get_tokenizer(config.data.tokenizer).vocab_size
  rows = model.get_config("tiny", V=V, vocab_multiple=config.model.vocab_multiple).padded_vocab
  return {"seconds_per_update": seconds, "tokens_per_update": tokens, "rows": rows}


def run_fwdbwd(variant: str, s: dict, args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from acco_jax import model

  padded = variant != f"V{s['V']}"
  cfg = _model_cfg(s, padded=padded, attention="xla" if variant == "xla" else "auto")
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.init_params(cfg, 0))
  tokens = np.random.default_rng(0).integers(0, cfg.V, size=(s["B"], s["L"] + 1), dtype=np.int32)
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
  fn = jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, cfg, batch)[0]))
  seconds = _timed(lambda: fn(params), args.steps * 3, args.warmup)
  return {
    "seconds_per_update": seconds,
    "tokens_per_update": s["B"] * s["L"],
    "rows": cfg.padded_vocab,
  }


def run_adamw(s: dict, args) -> dict:
  """One ``optax.adamw`` update of the float32 parameters: per jitted call (as the earlier
  measurement took it: the host passes ~600 arrays each call), and per update inside one program
  (a ``fori_loop`` of updates: the device's time alone, as inside the train step)."""
  import jax
  import optax

  from acco_jax import model

  params = model.init_params(_model_cfg(s), 0)
  tx = optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
  update = jax.jit(lambda g, o, p: optax.apply_updates(p, tx.update(g, o, p)[0]))
  opt = tx.init(params)
  seconds = _timed(lambda: update(params, opt, params), args.steps * 3, args.warmup)

  def body(_, carry):
    p, o = carry
    u, o = tx.update(p, o, p)  # the parameters stand in for the gradients, as above
    return optax.apply_updates(p, u), o

  n = args.steps * 3
  loop = jax.jit(lambda p, o: jax.lax.fori_loop(0, n, body, (p, o)))
  in_program = _timed(lambda: loop(params, opt), 1, 1) / n
  return {
    "seconds_per_update": seconds,
    "seconds_in_program": in_program,
    "tokens_per_update": None,
  }


def run_torch(variant: str, s: dict, args) -> dict:
  try:
    from bench.gpu import torch_gpt
  except ImportError as e:
    return {"skipped": f"torch is not installed ({e})"}
  rows = int(variant.removeprefix("V"))
  out = torch_gpt.run(
    rows=rows,
    V=s["V"],
    L=s["L"],
    D=s["D"],
    H=s["H"],
    N=s["N"],
    B=s["B"],
    k=s["k"],
    steps=args.steps,
    warmup=args.warmup,
    compile=not args.smoke,
  )
  return {
    "seconds_per_update": out["step_s"],
    "tokens_per_update": s["k"] * s["B"] * s["L"],
    "peak_bytes": out["peak_bytes"],
    "torch": out["torch"],
    "rows": rows,
  }


def run_hlo(method: str, s: dict, args) -> dict:
  """The GEMMs of the method's compiled stage, by operand dtypes, and XLA's memory estimate.

  On a GPU: the step as it runs (cuDNN attention). Elsewhere: compiled for an abstract H100 by the
  CUDA PJRT plugin, with ``attention='xla'`` (cuDNN attention cannot compile without a GPU); that
  fallback's score GEMMs are float32 by design and counted apart.
  """
  import jax

  import acco_jax
  from acco_jax import model, parallel
  from acco_jax.analysis import kernels

  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not parallel.has_cuda_plugin():
    return {"skipped": "no GPU and no CUDA PJRT plugin to compile for one"}
  devices = jax.devices()[:1] if on_gpu else parallel.gpu_aot_devices(1, "h100")
  cfg = _model_cfg(s, attention="auto" if on_gpu else "xla")
  k = s["k"] // 2 if method == "acco" else s["k"]
  tx = getattr(acco_jax, method)(_inner_optimizer())
  fn, fargs, _ = common.abstract_stage(cfg, tx, devices, k, s["B"])
  compiled = fn.lower(*fargs).compile()
  gemms = kernels.gemms(compiled.as_text())
  f32 = [g for g in gemms if set(g.dtypes) == {"f32"}]
  scores = [g for g in f32 if "BTNH,BSNH->BNTS" in g.op_name]  # attention='xla' only
  mem = compiled.memory_analysis()
  return {
    "compiled_for": devices[0].device_kind + ("" if on_gpu else " (abstract)"),
    "attention": model.attention_impl(cfg),
    "gemms": dict(collections.Counter("x".join(g.dtypes) for g in gemms)),
    "f32_gemms": len(f32),
    "f32_gemms_outside_attention_scores": len(f32) - len(scores),
    "argument_bytes": getattr(mem, "argument_size_in_bytes", None),
    "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
    "tokens_per_update": None,
  }


def run_row(name: str, args) -> dict:
  """One row, measured in this process."""
  import jax

  from acco_jax import model
  from acco_jax.run import metrics

  s = shapes(args)
  kind, _, variant = name.removesuffix("+cb").partition(":")
  start = time.perf_counter()
  if kind == "trainer":
    out = run_trainer(variant, s, args)
  elif kind == "step":
    out = run_step(variant, s, args)
  elif kind == "fwdbwd":
    out = run_fwdbwd(variant, s, args)
  elif kind == "adamw":
    out = run_adamw(s, args)
  elif kind == "torch":
    out = run_torch(variant, s, args)
  elif kind == "hlo":
    out = run_hlo(variant, s, args)
  else:
    raise SystemExit(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
  out.update(name=name, wall_s=round(time.perf_counter() - start, 1))
  if "skipped" in out:
    return out
  out.setdefault("peak_bytes", _peak_bytes())
  out.setdefault("rows", s["V"] if name.endswith(f"V{s['V']}") else _model_cfg(s).padded_vocab)
  if out["tokens_per_update"]:
    out["tokens_per_s"] = out["tokens_per_update"] / out["seconds_per_update"]
    peak = metrics.peak_flops(jax.devices()[0])
    flops = model.flops_per_token(_model_cfg(s))  # the real vocabulary
    out["mfu"] = out["tokens_per_s"] * flops / peak if peak else None
  return out
