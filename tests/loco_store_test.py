"""Workers that meet through a store (acco_jax.loco.transport) against the same workers on one mesh.

Here each worker is a thread with its own devices (two of the eight), its own step and its own
:class:`acco_jax.loco.store.RoundStore` on one directory: separate programs that share nothing but
the store. With every worker present in every round, ``θ_g`` equals the SPMD run's (the mean is
taken in another order, so to float tolerance), for every method. The processes launched by
``train.py`` are in ``loco_store_train_test.py``.
"""

import threading
import time

import jax
import numpy as np
import optax
import pytest

import acco_jax
from acco_jax import loco
from acco_jax.loco import base, programs
from acco_jax.loco import step as loco_step
from acco_jax.loco.store import RoundStore
from acco_jax.loco.transport import StoreTransport
from tests.loco_test import B, K, toy_batches, toy_loss, toy_params

D = 2  # devices per worker


def inner_tx(method):
  """SGD inside the workers: the mesh and the store sum the workers' payloads in another order,
  and Adam's normalisation would turn a last-bit difference at a near-zero gradient into a step
  of the learning rate's size; SGD keeps it a last-bit difference."""
  if method.payload == "gradient":
    return acco_jax.zero1(loco.keep_gradient())
  return acco_jax.zero1(optax.sgd(0.1, momentum=0.9))


def rows_of(x, i, m):
  """Worker ``i``'s rows of a global batch of ``m`` workers (worker-major, as on the mesh)."""
  return x[i * len(x) // m : (i + 1) * len(x) // m]


def drive(train, state, batches, total, share=None, start=0, end=None):
  """The trainer's loop over a step of a run of ``total`` inner steps, from ``start`` to ``end``
  (default: the end): each call takes its stages' batches (``share``: this worker's rows of each
  global batch)."""
  s = start
  while s < (total if end is None else end):
    n = train.schedule(s, total).stages
    take = batches[s : s + n]
    if share is not None:
      take = [jax.tree.map(lambda x: rows_of(x, *share), b) for b in take]
    state, _ = train.call(state, take, s, total)
    s += n
  return state


def spmd(method, workers, batches, total):
  mesh = loco_step.worker_mesh(workers, jax.devices()[: workers * D])
  train = loco_step.make_loco_step(
    toy_loss, inner_tx(method), method, mesh, num_microbatches=K, params=toy_params()
  )
  state = drive(train, train.init(toy_params()), batches, total)
  # each worker's θ_g (NoLoCo's slow weights differ from worker to worker)
  per_worker = lambda m: train.layout.from_shards(jax.tree.map(lambda x: x[m], state.outer.params))
  return [jax.device_get(per_worker(m)) for m in range(workers)]


def store_step(method, i, workers, url, snapshot_every=2, **store_kwargs):
  """Worker ``i``'s step on devices ``[i D, (i + 1) D)``, meeting the others in the store at
  ``url`` (its run checked, its lease taken)."""
  store_kwargs = {"grace_s": 60.0, "min_workers": workers, "poll_s": 0.01, **store_kwargs}
  store = RoundStore(url, i, **store_kwargs)
  store.check_run({"run": "loco_store_test", "method": method.name})
  store.acquire()
  transport = StoreTransport(store, i, workers, snapshot_every)
  mesh = loco_step.worker_mesh(1, jax.devices()[i * D : (i + 1) * D])
  return loco_step.make_loco_step(
    toy_loss,
    inner_tx(method),
    method,
    mesh,
    num_microbatches=K,
    params=toy_params(),
    transport=transport,
  )


def worker(method, i, workers, url, batches, total, out, **kwargs):
  train = store_step(method, i, workers, url, **kwargs)
  state = drive(train, train.init(toy_params()), batches, total, share=(i, workers))
  out[i] = jax.device_get(train.params(state))
  train.transport.close()


def through_store(method, workers, batches, total, url, running=None, **kwargs):
  """Each worker's final θ_g: ``running`` (default: all) of ``workers`` slots, each a thread."""
  out, errors = {}, []

  def run(i):
    try:
      worker(method, i, workers, url, batches, total, out, **kwargs)
    except BaseException as e:  # surfaced below
      errors.append(e)

  threads = [threading.Thread(target=run, args=(i,)) for i in running or range(workers)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:
    raise errors[0]
  return out


METHODS = {
  "diloco": lambda: loco.diloco(sync_every=2),
  "streaming_diloco": lambda: loco.streaming_diloco(
    sync_every=4, fragments=2, overlap_steps=1, quantize="none"
  ),
  "sparseloco": lambda: loco.sparseloco(sync_every=2, topk=8, chunk=8, bits=2),
  "demo": lambda: loco.demo(1e-2, topk=8, chunk=8),
  "noloco": lambda: loco.noloco(sync_every=2, pairings=4),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_store_workers_equal_the_mesh_when_all_are_present(name, tmp_path):
  method, workers, total = METHODS[name](), 4 if name == "noloco" else 2, 8
  batches = toy_batches(total, workers * D * K * B)
  want = spmd(method, workers, batches, total)
  got = through_store(method, workers, batches, total, str(tmp_path / "store"))
  for i in range(workers):
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    jax.tree.map(close, got[i], want[i])


def test_a_late_joiner_starts_from_the_latest_snapshot_and_the_rounds_after_it(tmp_path):
  """Workers 0 and 1 of 3 slots run 7 rounds (a snapshot before rounds 3 and 6, rounds below 3
  collected); worker 2 then starts: round 0 is gone, so it reads snapshot 6 (θ_g and the outer
  momentum) and applies round 6 from the members' payloads: its θ_g is the others' final one."""
  method, total, url = loco.diloco(sync_every=2), 14, str(tmp_path / "store")
  batches = toy_batches(total, 3 * D * K * B)
  kept = dict(snapshot_every=3, keep_rounds=3, min_workers=2)
  done = through_store(method, 3, batches, total, url, running=[0, 1], **kept)
  assert not (tmp_path / "store" / "rounds" / "00000000").exists()  # collected
  joined = {}
  worker(method, 2, 3, url, batches, 0, joined, **kept)  # no steps of its own: the state it joins
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  jax.tree.map(close, joined[2], done[0])
  jax.tree.map(close, done[1], done[0])


def test_a_worker_whose_round_was_collected_while_it_was_away_resyncs(tmp_path):
  """Worker 2 of 3 starts with the others, then is away (its lease held, so each round waits a
  short grace for it) while workers 0 and 1 run 7 rounds and the early ones are collected; its
  first sync finds its round gone: it reads snapshot 6 and round 6 and ends on the others' θ_g."""
  method, total, url = loco.diloco(sync_every=2), 14, str(tmp_path / "store")
  batches = toy_batches(total, 3 * D * K * B)
  train = store_step(method, 2, 3, url, snapshot_every=3, grace_s=0.2, min_workers=1)
  store = train.transport.store
  state = train.init(toy_params())  # nothing decided yet: its own start
  kept = dict(snapshot_every=3, keep_rounds=3, min_workers=2, grace_s=0.2)
  done = through_store(method, 3, batches, total, url, running=[0, 1], **kept)
  assert store.collected(0)
  state = drive(train, state, batches, 2, share=(2, 3))  # one sync: round 0, collected
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  jax.tree.map(close, jax.device_get(train.params(state)), done[0])


def test_a_noloco_joiner_starts_from_a_peers_snapshot(tmp_path):
  """NoLoCo keeps no global θ_g: a worker joining after 3 rounds of workers 0 and 1 starts from
  the snapshot their first member wrote (its slow weights after round 2), not from the init."""
  method, url = loco.noloco(sync_every=2, pairings=4), str(tmp_path / "store")
  batches = toy_batches(6, 4 * D * K * B)
  done = through_store(
    method, 4, batches, 6, url, running=[0, 1], snapshot_every=3, keep_rounds=3, min_workers=2
  )
  joined = {}
  worker(method, 2, 4, url, batches, 0, joined, snapshot_every=3, keep_rounds=3)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  jax.tree.map(close, joined[2], done[0])  # worker 0 wrote snapshot 3, its θ_g after round 2


def test_a_sparse_worker_late_for_its_round_keeps_its_whole_payload(tmp_path):
  """SparseLoCo, 2 slots: round 0 is decided with worker 1 alone (a short grace); worker 0 then
  reaches its sync late. It applies round 0 (caught up: the others' θ_g) and, nothing of its
  payload having been sent, its error feedback is all of it: ``β·0 + 1·Δ`` with ``Δ = θ_g − θ_m``
  before the sync (not the feedback less a top-k that no round took)."""
  method, url = METHODS["sparseloco"](), str(tmp_path / "store")
  batches = toy_batches(2, 2 * D * K * B)
  step = store_step(method, 0, 2, url, grace_s=0.2, min_workers=1)
  state = step.init(toy_params())  # nothing decided yet: its own start
  done = through_store(method, 2, batches, 2, url, running=[1], grace_s=0.2, min_workers=1)
  for b in batches:  # its two inner steps, then the sync by hand
    b = jax.tree.map(lambda x: rows_of(x, 0, 2), b)
    state, _ = step.program("stage", None, state)(state, step.put_batch(b))
  delta = base.pseudo_gradient(state.outer.params, programs.worker_params(state))
  delta = jax.device_get(delta)
  state, metrics = step.transport.sync(step, state)
  step.transport.close()
  assert int(metrics["outer_caught_up"]) == 1 and int(state.round) == 1
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  jax.tree.map(close, jax.device_get(state.comp), delta)
  jax.tree.map(close, jax.device_get(step.params(state)), done[1])


def test_a_worker_asked_to_stop_while_it_waits_for_its_round_returns_at_once(tmp_path):
  """Worker 0 of 2 (``min_workers=2``, a 60 s grace) waits for worker 1 at its first sync and is
  asked to stop (the trainer's SIGTERM flag, through ``watch_stop``): its call returns at once,
  the sync cut (its payload published, the round undecided, the state marked), where it would
  wait for worker 1. Worker 1 then comes; worker 0, driven on, finishes the cut sync at
  its next call first: both workers apply both rounds with both members and end on one θ_g."""
  method, url, total = loco.diloco(sync_every=2), str(tmp_path / "store"), 4
  batches = toy_batches(total, 2 * D * K * B)
  late = store_step(method, 1, 2, url)  # its lease held: live, so the round waits for it
  step = store_step(method, 0, 2, url)
  requested = threading.Event()
  step.watch_stop(requested.is_set)
  out = {}

  def first_round():
    out["state"] = drive(step, step.init(toy_params()), batches, total, share=(0, 2), end=2)

  waiting = threading.Thread(target=first_round, daemon=True)
  waiting.start()
  store = step.transport.store
  until = time.monotonic() + 120
  while store.arrived(0, D) != [0]:  # published: now waiting for worker 1
    assert time.monotonic() < until and waiting.is_alive()
    time.sleep(0.01)
  requested.set()
  stopped_at = time.monotonic()
  waiting.join(timeout=10)
  assert not waiting.is_alive(), "the wait did not give up"
  assert time.monotonic() - stopped_at < 5.0  # a poll of 0.5 s at most; loose for a loaded machine
  cut = out["state"]
  assert store.decided(0) is None and int(cut.round) == 0 and int(cut.inflight_fragment) == 0
  other = {}
  second = threading.Thread(
    target=lambda: other.update(
      state=drive(late, late.init(toy_params()), batches, total, share=(1, 2))
    )
  )
  second.start()
  state = drive(step, cut, batches, total, share=(0, 2), start=2)  # the flag still set
  second.join()
  for t in (step, late):
    t.transport.close()
  assert store.decided(0) == [0, 1] and store.decided(1) == [0, 1]
  assert int(state.round) == 2 and int(state.inflight_fragment) == -1
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  jax.tree.map(
    close, jax.device_get(step.params(state)), jax.device_get(late.params(other["state"]))
  )
