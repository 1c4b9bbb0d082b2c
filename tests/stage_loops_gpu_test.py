"""The microbatch loops of the XLA:GPU-compiled stage: a trip count XLA knows, so no host round trip.

XLA:GPU runs a ``while`` whose trip count it does not know by copying the loop predicate to the host
after every iteration (a ``MemcpyD2H`` each, in an H100 profile of the old loop with traced bounds):
the host's call returns only after the loop, and the next stage is dispatched late. The stages of
ZeRO-1 and ACCO, compiled for two abstract H100s (:func:`acco_jax.parallel.gpu_aot_devices`, the
CUDA PJRT plugin, no GPU), must carry ``known_trip_count`` on every microbatch loop: ``k`` for
ZeRO-1's, ``ceil(k/2)`` and ``k - ceil(k/2)`` for ACCO's two. A stage run with per-device budgets
(heterogeneous workers) keeps its traced bounds on purpose, so that a slow device computes fewer
microbatches: its loops have no known trip count, and the test says so.

Marked ``cuda_plugin``: ``.ci/run`` installs the plugin and runs these in its second step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import acco_jax
from acco_jax import model, parallel
from acco_jax.analysis import hlo
from tests import cuda_plugin

pytestmark = cuda_plugin.MARKS

N, ROWS, L = 2, 2, 32  # devices, rows per microbatch, tokens per row


def compiled_loops(method: str, k: int, budgeted: bool) -> list[hlo.WhileLoop]:
  cfg = model.get_config("tiny", V=256, L=L, D=32, H=2, N=1, attention="xla")
  shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
  mesh = jax.sharding.Mesh(np.array(parallel.gpu_aot_devices(N, "h100")), ("data",))
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  train = acco_jax.make_train_step(
    lambda p, b: model.loss_fn(p, cfg, b),
    acco_jax.get_method(method, inner),
    mesh,
    num_microbatches=k,
    params=shapes,
    has_aux=True,
  )
  state = train.abstract_state(shapes)
  data = NamedSharding(train.mesh, P("data"))
  batch = {
    key: jax.ShapeDtypeStruct((N * k * ROWS, L), jnp.int32, sharding=data)
    for key in ("inputs", "targets")
  }
  args = (state, batch)
  if budgeted:
    args += (jax.ShapeDtypeStruct((N,), jnp.int32, sharding=data),)
  kind = "delayed" if train.plan.delayed else "sync"
  text = train.stage_program(kind, state, budgeted).lower(*args).compile().as_text()
  return hlo.while_loops(text)


@pytest.mark.parametrize(("method", "k", "trips"), [("zero1", 3, [3]), ("acco", 5, [3, 2])])
def test_microbatch_loops_have_known_trip_counts(method, k, trips):
  loops = compiled_loops(method, k, budgeted=False)
  assert sorted(w.trip_count or 0 for w in loops) == sorted(trips), loops


@pytest.mark.parametrize("method", ["zero1", "acco"])
def test_budgeted_stages_keep_traced_bounds(method):
  """Per-device counts are values of the program, not of its shape: XLA cannot know the trip
  count, which is what lets a slow device stop early (and costs a host round trip per microbatch)."""
  loops = compiled_loops(method, 4, budgeted=True)
  assert loops and all(w.trip_count is None for w in loops), loops
