"""NoLoCo, SparseLoCo and DeMo on the worker mesh against NumPy references written here from
loco-family.md §3-§8 (not from the library), their reductions to simpler methods, what their
compiled programs move between workers, and bit-exact resume of all their state.

Toy problem of ``loco_test.py``: M = 4 workers of D = 2 devices, a few syncs. The inner steps of the
references are the tree-based ones of ``loco_test.py`` (jax.grad + optax on whole trees); everything
a sync does is NumPy, on each device's shard row of each leaf (chunks never straddle shards).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import acco_jax
from acco_jax import loco
from acco_jax.analysis import hlo
from acco_jax.ckpt.checkpoint import Checkpointer
from acco_jax.loco import step as loco_step
from acco_jax.loco.noloco import consensus_gradient, matchings, pairing_index
from tests.loco_references import (
  D,
  M,
  np_tree,
  ref_demo,
  ref_noloco,
  ref_sparseloco,
)
from tests.loco_test import (
  B,
  K,
  assert_trees_close,
  run,
  toy_batches,
  toy_params,
  worker_grad,
)

# -- running the library ---------------------------------------------------------------------------


def demo_tx():
  return acco_jax.zero1(
    optax.chain(optax.clip_by_global_norm(1.0), loco.keep_gradient()), comm_dtype=jnp.float32
  )


def outer_params(train, state):
  """Every worker's θ_g (NoLoCo: φ_i) as a tree of [M, ...] arrays of the original shapes."""
  fn = jax.jit(lambda s: jax.vmap(train.layout.from_shards)(s.outer.params))
  return jax.device_get(fn(state))


def worker(tree, m):
  return jax.tree.map(lambda x: x[m], tree)


# 3 of 16 per 4 x 4 tile, a few 1-D chunks; an outer lr other than 1, so the reference test sees
# where α applies (the outer step, not the error feedback: ef_scale="one")
SPARSE = dict(topk=3, chunk=4, bits=2, decay=0.95, outer_lr=0.5)
DEMO = dict(topk=4, chunk=4, decay=0.9)
# DeMo's reference run: η falls linearly from 1e-2 to 4e-3 over 4 steps (so a step that read the
# schedule at the wrong count would show), with decoupled weight decay λ = 0.1
DEMO_LRS, DEMO_WD = [1e-2 - 1.5e-3 * t for t in range(4)], 0.1


@pytest.fixture(scope="module")
def batches():
  return toy_batches(6, M * D * K * B)


@pytest.fixture(scope="module")
def sparseloco_run(batches):
  method = loco.sparseloco(2, **SPARSE)
  return run(method, M, D, batches)


# Seed 4 picks matchings 0, 3, 4 of 5 at the three syncs, which pair the 4 workers differently each
# time: from the second sync on a worker meets a peer whose slow weights differ from its own, so the
# consensus term moves the result (a seed whose picks repeat one pairing would leave it at 0).
NOLOCO = dict(pairings=5, seed=4)


@pytest.fixture(scope="module")
def noloco_run(batches):
  return run(loco.noloco(2, **NOLOCO), M, D, batches)


@pytest.fixture(scope="module")
def demo_run(batches):
  lr = optax.linear_schedule(1e-2, 4e-3, 4)
  return run(loco.demo(lr, weight_decay=DEMO_WD, **DEMO), M, D, batches[:4], demo_tx())


# -- SparseLoCo ------------------------------------------------------------------------------------


@pytest.mark.slow  # ~30 s: the reference's own compression of every worker's pseudo-gradient
def test_sparseloco_matches_reference(sparseloco_run, batches):
  train, state, logged = sparseloco_run
  glob, ef, plans = ref_sparseloco(batches, 2, **SPARSE)
  assert 0 < train.density() < 0.4  # a real top-k
  got = outer_params(train, state)
  for m in range(M):
    assert_trees_close(worker(got, m), glob, rtol=1e-4, atol=1e-5)
  comp = jax.device_get(state.comp)
  for m in range(M):
    for li, x in enumerate(jax.tree.leaves(comp)):  # the residuals stay with their workers
      np.testing.assert_allclose(np.asarray(x)[m], ef[m][li], rtol=1e-4, atol=1e-5)
  outer = [r for r in logged if "outer_fragment" in r]
  assert len(outer) == 3


def max_gap(a, b):
  return max(
    float(np.abs(np.asarray(x) - np.asarray(y)).max())
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


# α = 0.5 runs by default (outer_lr against the reference, where the conventions part: SparseLoCo's
# reference check in the default run); α = 1.0 (outer_lr equals the default there) and the default
# convention's reference test, test_sparseloco_matches_reference, in the slow step
@pytest.mark.parametrize("lr", [pytest.param(1.0, marks=pytest.mark.slow), 0.5])
def test_sparseloco_ef_scale_conventions(batches, lr):
  """ef_scale="outer_lr" (e ← βe + αΔ, the reference code) against the reference: the same as the
  default e ← βe + Δ at α = 1 (the published setting), another run at α = 0.5."""
  bs = batches[:4]  # two syncs: the second sees the first's residual
  train, state, _ = run(
    loco.sparseloco(2, **{**SPARSE, "outer_lr": lr, "ef_scale": "outer_lr"}), M, D, bs
  )
  got = worker(outer_params(train, state), 0)
  scaled, ef, _ = ref_sparseloco(bs, 2, **{**SPARSE, "outer_lr": lr, "ef_scale": "outer_lr"})
  plain, _, _ = ref_sparseloco(bs, 2, **{**SPARSE, "outer_lr": lr, "ef_scale": "one"})
  assert_trees_close(got, scaled, rtol=1e-4, atol=1e-5)
  for li, x in enumerate(jax.tree.leaves(jax.device_get(state.comp))):
    for m in range(M):
      np.testing.assert_allclose(np.asarray(x)[m], ef[m][li], rtol=1e-4, atol=1e-5)
  if lr == 1.0:
    assert_trees_close(got, plain, rtol=1e-4, atol=1e-5)
  else:
    assert max_gap(got, plain) > 1e-2  # the two conventions part


def test_sparseloco_ef_scale_must_be_known():
  with pytest.raises(ValueError, match=r"loco.ef_scale='lr': choose 'one' .* or 'outer_lr'"):
    loco.sparseloco(2, ef_scale="lr")


def test_sparseloco_workers_stay_bit_identical(sparseloco_run):
  train, state, _ = sparseloco_run
  got, local = outer_params(train, state), train.worker_params(state)
  for m in range(1, M):
    for a, b, c in zip(
      jax.tree.leaves(got), jax.tree.leaves(local), jax.tree.leaves(got), strict=True
    ):
      # exact: every worker decodes the same bytes into the same outer step (a product promise)
      np.testing.assert_array_equal(np.asarray(a)[m], np.asarray(a)[0])
      np.testing.assert_array_equal(np.asarray(b)[m], np.asarray(c)[0])  # θ_m = θ_g after a sync


@pytest.mark.slow  # a secondary identity; test_sparseloco_matches_reference runs by default
def test_sparseloco_full_k_no_quantiser_is_momentum_free_diloco(batches):
  full = loco.sparseloco(3, topk=16, chunk=4, bits=32, decay=0.0, outer_lr=1.0)
  batches = batches[:3]  # one sync
  train, state, _ = run(full, M, D, batches)
  assert train.density() == 1.0
  plain = loco.diloco(3, outer=loco.default_outer(lr=1.0, momentum=0.0))
  ref_train, ref_state, _ = run(plain, M, D, batches)
  assert_trees_close(train.params(state), ref_train.params(ref_state), rtol=1e-5, atol=1e-6)


# -- NoLoCo ----------------------------------------------------------------------------------------


def test_noloco_matches_reference(noloco_run, batches):
  train, state, logged = noloco_run
  phi, gaps = ref_noloco(batches, 2, count=NOLOCO["pairings"], seed=NOLOCO["seed"])
  assert gaps[0] == 0 and min(gaps[1:]) > 1e-2  # pairs of unequal φ: the consensus term counts
  got = outer_params(train, state)
  for m in range(M):
    assert_trees_close(worker(got, m), phi[m], rtol=1e-4, atol=1e-5)
  local = train.worker_params(state)
  for m in range(M):  # θ_i ← φ_i
    assert_trees_close(worker(local, m), phi[m], rtol=1e-4, atol=1e-5)
  spread = max(
    float(np.abs(np.asarray(x)[0] - np.asarray(x)[1]).max()) for x in jax.tree.leaves(got)
  )
  assert spread > 1e-4  # each worker keeps its own φ_i
  picks = [int(r["outer_pairing"]) for r in logged if "outer_pairing" in r]
  key, count = jax.random.key(NOLOCO["seed"]), NOLOCO["pairings"]
  assert picks == [
    int(jax.random.randint(jax.random.fold_in(key, t), (), 0, count)) for t in range(3)
  ]


def test_pairings_are_perfect_matchings_agreed_without_talking():
  for workers, seed in ((2, 0), (4, 1), (8, 2)):
    table = matchings(workers, 16, seed)
    for row in table:
      assert (row[row] == np.arange(workers)).all() and (row != np.arange(workers)).all()
    np.testing.assert_array_equal(table, matchings(workers, 16, seed))  # same seed, same
  assert not np.array_equal(matchings(8, 16, 0), matchings(8, 16, 1))
  with pytest.raises(ValueError, match="needs an even number"):
    matchings(3, 4, 0)
  # every worker computes the pick from the seed and the sync index alone: inside a program over
  # the worker axis, each worker's own computation gives the same matching
  mesh = loco_step.worker_mesh(M, jax.devices()[: M * D])

  def local(sync):
    return pairing_index(7, sync[0, 0], 16)[None, None]

  spec = jax.P("replica", "data")
  picks = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))(
    jnp.full((M, D), 5, jnp.int32)
  )
  assert len(set(np.asarray(picks).reshape(-1).tolist())) == 1


def test_consensus_term_sums_to_zero_over_a_pair_and_vanishes_for_equal_phi():
  r = np.random.default_rng(0)
  delta_mean, phi_i, phi_j = (r.normal(size=5) for _ in range(3))
  phi_bar = (phi_i + phi_j) / 2
  g_i = consensus_gradient(delta_mean, phi_i, phi_bar)
  g_j = consensus_gradient(delta_mean, phi_j, phi_bar)
  np.testing.assert_allclose((g_i - delta_mean) + (g_j - delta_mean), 0.0, atol=1e-12)
  np.testing.assert_array_equal(consensus_gradient(delta_mean, phi_i, phi_i), delta_mean)


def test_consensus_pulls_each_phi_toward_the_pair_mean():
  """loco-family.md §3 with d̄ = 0 and δ = 0: δ_i = γ (φ̄ − φ_i), so after the outer step
  φ_i − φ̄ = (1 − γ)(φ_i − φ̄) (a wrong sign would push it away, to 1 + γ)."""
  gamma = 0.7
  outer = loco.noloco(50, outer_lr=gamma, momentum=0.5).outer
  r = np.random.default_rng(1)
  phi_i, phi_j = (r.normal(size=5).astype(np.float32) for _ in range(2))
  phi_bar = (phi_i + phi_j) / 2
  g = consensus_gradient(np.zeros(5, np.float32), phi_i, phi_bar)
  update, _ = outer.update(g, outer.init(phi_i), phi_i)
  new = phi_i + np.asarray(update)
  np.testing.assert_allclose(new - phi_bar, (1 - gamma) * (phi_i - phi_bar), rtol=1e-5, atol=1e-6)


def test_noloco_with_all_workers_as_one_group_is_heavy_ball_diloco(batches):
  """n = N = 2 and equal φ: one pair is everyone, so NoLoCo is DiLoCo with a heavy-ball outer step."""
  bs = toy_batches(4, 2 * 4 * K * B)
  train, state, _ = run(loco.noloco(2), 2, 4, bs)
  heavy = loco.diloco(2, outer=loco.default_outer(0.7, 0.5, nesterov=False))
  ref_train, ref_state, _ = run(heavy, 2, 4, bs)
  got = outer_params(train, state)
  assert_trees_close(worker(got, 0), ref_train.params(ref_state), rtol=1e-5, atol=1e-6)
  for a in jax.tree.leaves(got):  # exact: both apply one outer step to the same all-reduced values
    np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(a)[1])


# -- DeMo ------------------------------------------------------------------------------------------


def test_demo_matches_reference(demo_run, batches):
  train, state, logged = demo_run
  params, mom = ref_demo(batches[:4], DEMO_LRS, **DEMO, wd=DEMO_WD)
  got = outer_params(train, state)
  local = train.worker_params(state)
  for m in range(M):
    assert_trees_close(worker(got, m), params, rtol=1e-5, atol=1e-6)
    assert_trees_close(worker(local, m), params, rtol=1e-5, atol=1e-6)
  comp = jax.device_get(state.comp)
  for m in range(M):
    for li, x in enumerate(jax.tree.leaves(comp)):
      np.testing.assert_allclose(np.asarray(x)[m], mom[m][li], rtol=1e-4, atol=1e-6)
  assert sum("outer_fragment" in r for r in logged) == 4  # a sync every step


def test_demo_workers_stay_bit_identical(demo_run):
  train, state, _ = demo_run
  for tree in (outer_params(train, state), train.worker_params(state)):
    for x in jax.tree.leaves(tree):
      for m in range(1, M):  # exact: every worker decodes the same bytes (a product promise)
        np.testing.assert_array_equal(np.asarray(x)[m], np.asarray(x)[0])


def test_demo_one_worker_full_k_is_sign_sgd(batches):
  """N = 1, k = the chunk: everything is sent, the momentum drains to 0 each step, and the update
  is sign-SGD on η g."""
  bs = toy_batches(3, 1 * 8 * K * B)
  lr = 1e-2
  train, state, _ = run(loco.demo(lr, topk=16, chunk=4, decay=0.9), 1, 8, bs, demo_tx())
  assert train.density() == 1.0
  for x in jax.tree.leaves(jax.device_get(state.comp)):
    assert np.abs(np.asarray(x)).max() < 1e-7
  p = np_tree(toy_params())
  for batch in bs:
    g = np_tree(worker_grad(jax.tree.map(jnp.asarray, p), batch, 0, 1, 8))
    norm = np.sqrt(sum((x.astype(np.float64) ** 2).sum() for x in jax.tree.leaves(g)))
    scale = lr * min(1.0, 1.0 / norm)  # η times the clipping factor
    p = jax.tree.map(lambda w, x, c=scale: w - lr * np.sign(c * x), p, g)
  assert_trees_close(train.params(state), p, rtol=0, atol=1e-6)


# -- what the compiled programs move between workers ------------------------------------------------


def cross_worker(train, kind, state, batch=None):
  """The collectives of a compiled program that move data between workers."""
  fn = train.program(kind, 0 if kind == "sync" else None, state)
  args = (state,) if kind == "sync" else (state, train.put_batch(batch))
  found = hlo.hlo_collectives(fn.lower(*args).compile().as_text())
  per = train.num_devices
  return [c for c in found if hlo.crosses(c, lambda i: i // per)]


def test_noloco_programs_only_collective_permute(noloco_run, batches):
  train, state, _ = noloco_run
  assert cross_worker(train, "stage", state, batches[0]) == []
  sync = cross_worker(train, "sync", state)
  assert sync and {c.kind for c in sync} == {"collective-permute"}, sync
  assert len(sync) == 5  # one branch per matching, each one ppermute of [Δ | φ]
  for c in sync:  # each device sends its shard row of Δ and φ: 2 x 4 bytes x values
    assert c.bytes == 2 * 4 * train.layout.shard_size


def test_demo_programs_have_no_all_reduce_between_workers(demo_run, batches):
  train, state, _ = demo_run
  assert cross_worker(train, "stage", state, batches[0]) == []  # no gradient all-reduce
  sync = cross_worker(train, "sync", state)
  assert [c.kind for c in sync] == ["all-gather"], sync
  assert sync[0].shape[0][0] == "u8"  # the packed bytes themselves
  assert sync[0].bytes == M * train.codec.row_bytes


def test_sparseloco_and_diloco_syncs(sparseloco_run, batches):
  train, state, _ = sparseloco_run
  sync = cross_worker(train, "sync", state)
  assert [(c.kind, c.shape[0][0]) for c in sync] == [("all-gather", "u8")], sync
  assert sync[0].bytes == M * train.codec.row_bytes
  assert train.payload_bytes(0) == D * train.codec.row_bytes
  dense, dstate, _ = run(loco.diloco(2), M, D, batches[:2])
  sync = cross_worker(dense, "sync", dstate)  # one all-reduce of the parameters, nothing else
  assert [c.kind for c in sync] == ["all-reduce"] and sync[0].bytes == 4 * dense.layout.shard_size


# -- bit-exact resume of every state (error feedback, momenta, φ_i and δ_i, the pairing stream) ----


@pytest.mark.parametrize("name", ["noloco", "sparseloco", "demo"])
def test_resume_from_a_checkpoint_is_bit_exact(name, tmp_path, batches, request):
  """Stop halfway (after a sync), checkpoint, restore into a fresh state, finish: the same bits as
  the uninterrupted run of the fixture, for every buffer."""
  train, whole, _ = request.getfixturevalue(f"{name}_run")
  total = 4 if name == "demo" else 6
  state = train.init(toy_params())
  for s in range(total // 2):
    state, _ = train.call(state, batches[s : s + 1], s, total)
  with Checkpointer(str(tmp_path), async_save=False) as ckpt:
    ckpt.save(total // 2, state, extra={})
  del state
  with Checkpointer(str(tmp_path)) as ckpt:
    state, _ = ckpt.restore(None, train.abstract_state(toy_params()))
  if name != "noloco":  # error feedback / momentum are in the checkpoint
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(state.comp))
  for s in range(total // 2, total):
    state, _ = train.call(state, batches[s : s + 1], s, total)
  for a, b in zip(
    jax.tree.leaves(jax.device_get(whole)), jax.tree.leaves(jax.device_get(state)), strict=True
  ):
    np.testing.assert_array_equal(a, b)  # exact: the same programs (one stage per call) rerun
