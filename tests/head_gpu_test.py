"""The head and the loss in the XLA:GPU-compiled step: bf16 GEMMs, a padded vocabulary, no f32 logits.

XLA:GPU compiles a small GPT's ZeRO-1 stage for one abstract H100
(:func:`acco_jax.parallel.gpu_aot_devices`, the CUDA PJRT plugin, no GPU), with V = 1000 padded
to 1024 (``vocab_multiple=128``). The optimized module is read with :func:`acco_jax.analysis.kernels.gemms`:

* no GEMM of the head (forward, input gradient, weight gradient) has a float32 x float32 operand
  pair, and no GEMM outside attention has one either (the model's ``attention='xla'`` fallback takes
  its scores in float32 by design; on a GPU the step uses cuDNN attention, which has no dot);
* the head's GEMMs run over the padded 1024 columns and no GEMM sees the unpadded 1000;
* the microbatch loop writes no float32 array of the logits' size (the loss's float32 statistics
  stay inside its fusions).

Marked ``cuda_plugin``: ``.ci/run`` installs the plugin and runs these in its second step.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acco_jax
from acco_jax import model, parallel
from acco_jax.analysis import hlo, kernels
from tests import cuda_plugin

pytestmark = cuda_plugin.MARKS

V, VP, L, D, ROWS, K = 1000, 1024, 32, 64, 4, 2  # ROWS per microbatch, K microbatches per stage
HEAD = "bld,vd->blv"  # the head's einsum, named in every GEMM it becomes


@pytest.fixture(scope="module")
def compiled_text() -> str:
  cfg = model.get_config("tiny", V=V, L=L, D=D, H=2, N=1, vocab_multiple=128, attention="xla")
  assert cfg.padded_vocab == VP
  shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
  mesh = jax.sharding.Mesh(np.array(parallel.gpu_aot_devices(1, "h100")), ("data",))
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, b1=0.9, b2=0.95))
  train = acco_jax.make_train_step(
    lambda p, b: model.loss_fn(p, cfg, b),
    acco_jax.zero1(inner),
    mesh,
    num_microbatches=K,
    params=shapes,
    has_aux=True,
  )
  state = train.abstract_state(shapes)
  data = NamedSharding(train.mesh, P("data"))
  batch = {
    k: jax.ShapeDtypeStruct((K * ROWS, L), jnp.int32, sharding=data) for k in ("inputs", "targets")
  }
  return train.stage_program("sync", state).lower(state, batch).compile().as_text()


def _dims_list(shape: str) -> list[int]:
  """``'f32[4,32,1024]{2,1,0}'`` -> ``[4, 32, 1024]`` (the layout is not a dimension)."""
  return [int(d) for d in re.findall(r"\d+", shape.split("[", 1)[1].split("]", 1)[0])]


def _dims(shape: str) -> set[int]:
  return set(_dims_list(shape))


def test_no_float32_gemm_in_head_or_loss(compiled_text):
  gs = kernels.gemms(compiled_text)
  head = [g for g in gs if HEAD in g.op_name]
  assert len(head) >= 3, [g.op_name for g in gs]  # forward, input gradient, weight gradient
  f32 = lambda g: g.dtypes == ("f32", "f32")
  bad = [f"{g.name}: {g.operands} -> {g.result} ({g.op_name})" for g in head if f32(g)]
  assert not bad, "float32 x float32 GEMMs in the head:\n" + "\n".join(bad)
  elsewhere = [
    f"{g.name}: {g.operands} ({g.op_name})"
    for g in gs
    if f32(g) and "BTNH,BSNH->BNTS" not in g.op_name  # XLA attention's f32 scores (cuDNN on GPU)
  ]
  assert not elsewhere, "float32 x float32 GEMMs outside attention:\n" + "\n".join(elsewhere)


def _numel(shape: str) -> int:
  return int(np.prod(_dims_list(shape)))


def test_head_runs_over_the_padded_vocabulary(compiled_text):
  """Each head GEMM reads the [VP, D] embedding or the [ROWS*L, VP] logits' cotangent (by size:
  XLA may split the contracting dimension, e.g. 1024 as 16 x 64); none reads an unpadded one."""
  gs = kernels.gemms(compiled_text)
  padded, unpadded = {VP * D, ROWS * L * VP}, {V * D, ROWS * L * V}
  for g in (g for g in gs if HEAD in g.op_name):
    assert padded & {_numel(s) for s in g.operands}, (g.name, g.operands, g.result)
  bad = [g.name for g in gs if unpadded & {_numel(s) for s in (*g.operands, g.result)}]
  assert not bad, f"GEMMs over the unpadded vocabulary: {bad}"


def test_loop_writes_no_float32_logits(compiled_text):
  comps, _ = hlo.parse_hlo(compiled_text)
  bodies = set()
  for instrs in comps.values():
    for i in instrs:
      if i.opcode == "while":
        bodies |= set(re.findall(r"body=%?([\w.\-]+)", i.rest))
  assert bodies
  big_f32 = [
    f"{i.name} = {i.shape.split('{')[0]} {i.opcode}"
    for b in bodies
    for i in comps[b]
    if i.opcode not in ("parameter", "get-tuple-element", "bitcast", "tuple")
    and i.shape.startswith("f32[")
    and any(v in _dims(i.shape) and _numel(i.shape) == ROWS * L * v for v in (V, VP))
  ]
  assert not big_f32, "float32 arrays of the logits' size in the microbatch loop:\n" + "\n".join(
    big_f32
  )


def test_benchmark_counts_the_gemms_of_each_method():
  """``bench/gpu/gpu_throughput.py``'s ``hlo:<method>`` rows (the "no f32 x f32 GEMM" target) on the
  smoke shapes: ACCO's delayed stage, with its two microbatch loops and the update between them,
  holds no float32 x float32 GEMM either, and the count sets XLA attention's scores apart."""
  from types import SimpleNamespace

  from bench.gpu import gpu_throughput, throughput_rows

  shapes = throughput_rows.shapes(SimpleNamespace(smoke=True))
  rows = {m: throughput_rows.run_hlo(m, shapes, None) for m in ("zero1", "acco")}
  for m, r in rows.items():
    assert r["compiled_for"].startswith("NVIDIA H100") and r["attention"] == "xla", m
    assert r["f32_gemms_outside_attention_scores"] == 0, (m, r["gemms"])
    assert r["f32_gemms"] > 0 and r["gemms"]["bf16xbf16"] > 0, (m, r["gemms"])
    assert sum(r["gemms"].values()) == r["gemms"]["bf16xbf16"] + r["f32_gemms"], (m, r["gemms"])
    assert r["temp_bytes"] > 0 and r["argument_bytes"] > 0, m
  # the smoke shapes give ACCO one microbatch per stage: loop A's, and no loop B (its bounds are
  # static, an empty loop is not compiled), so one differentiation per stage, as ZeRO-1's one loop
  assert rows["acco"]["f32_gemms"] == rows["zero1"]["f32_gemms"]
  named = {f"hlo:{m}": r for m, r in rows.items()}
  key = "f32 x f32 GEMMs in the steps, xla attention's scores apart (== 0)"
  assert gpu_throughput.summarise(named)[key] == 0
