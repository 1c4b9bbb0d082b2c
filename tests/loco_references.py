"""NumPy references of NoLoCo, SparseLoCo and DeMo for ``loco_family_test.py``, written from
loco-family.md §3-§8 (not from the library): everything a sync does, on each device's shard row of
each leaf (chunks never straddle shards); the inner steps are ``loco_test.py``'s tree-based ones
(jax.grad + optax on whole trees). M = 4 workers of D = 2 devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.fft

from acco_jax.loco import compress
from tests.loco_test import inner_opt, toy_params, worker_grad

M, D = 4, 2

# -- reference pieces (NumPy, one device row of one leaf at a time) --------------------------------


def leaf_rows(x, d=D):
  """A leaf as the flat layout's d shard rows (raveled, zero-padded)."""
  flat = np.asarray(x, np.float32).reshape(-1)
  s = -(-flat.size // d)
  return np.pad(flat, (0, d * s - flat.size)).reshape(d, s)


def rows_leaf(rows, shape):
  return rows.reshape(-1)[: int(np.prod(shape))].reshape(shape)


def chunks(row, plan):
  """A row -> [T, c1 c2]: the (rows x cols) block's c1 x c2 tiles, row-major, each flattened."""
  block = np.pad(row, (0, plan.rows * plan.cols - row.size)).reshape(plan.rows, plan.cols)
  return np.stack(
    [
      block[i : i + plan.c1, j : j + plan.c2].reshape(-1)
      for i in range(0, plan.rows, plan.c1)
      for j in range(0, plan.cols, plan.c2)
    ]
  )


def unchunks(tiles, plan):
  block = np.zeros((plan.rows, plan.cols), np.float32)
  t = 0
  for i in range(0, plan.rows, plan.c1):
    for j in range(0, plan.cols, plan.c2):
      block[i : i + plan.c1, j : j + plan.c2] = tiles[t].reshape(plan.c1, plan.c2)
      t += 1
  return block.reshape(-1)[: plan.length]


def top(tiles, k):
  """Positions of the k largest |x| per tile (the lower position first on a tie)."""
  return np.argsort(-np.abs(tiles), axis=-1, kind="stable")[:, :k]


def quantise(v, nbits=2, spread=6.0):
  """loco-family.md §4: shift, σ, step = spread σ / bins, codes, per-bin mean lookup."""
  v = v.astype(np.float32)
  bins = 2**nbits
  shift = v.mean(dtype=np.float32)
  c = v - shift
  sigma = np.sqrt((c * c).sum(dtype=np.float32) / (v.size - 1)) if v.size > 1 else 0.0
  step = spread * sigma / bins if sigma > 0 else 1.0
  code = np.clip(np.round(c / step + bins / 2), 0, bins - 1).astype(int)
  lut = np.array([c[code == b].mean() if (code == b).any() else 0.0 for b in range(bins)])
  return (lut[code] + shift).astype(np.float32)


def scatter_mean(sent, size, mode="mean_contributors"):
  """sent: one (positions [T, k], values [T, k]) per worker -> [T, size]."""
  t = sent[0][0].shape[0]
  total, count = np.zeros((t, size), np.float32), np.zeros((t, size), np.float32)
  for pos, val in sent:
    for i in range(t):
      total[i, pos[i]] += val[i]
      count[i, pos[i]] += 1
  if mode == "mean_R":
    return total / len(sent)
  return np.where(count > 0, total / np.maximum(count, 1), 0.0)


def dct2(tiles, plan):
  x = tiles.reshape(-1, plan.c1, plan.c2)
  return scipy.fft.dctn(x, type=2, norm="ortho", axes=(1, 2)).reshape(tiles.shape)


def idct2(tiles, plan):
  x = tiles.reshape(-1, plan.c1, plan.c2)
  return scipy.fft.idctn(x, type=2, norm="ortho", axes=(1, 2)).reshape(tiles.shape)


def inner_steps(theta, states, batch):
  """One inner AdamW step of every worker on its block of the batch (loco_test's reference)."""
  inner = inner_opt()
  for m in range(M):
    u, states[m] = inner.update(worker_grad(theta[m], batch, m, M, D), states[m], theta[m])
    theta[m] = optax.apply_updates(theta[m], u)


def np_tree(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)


# -- the references ---------------------------------------------------------------------------------


def ref_sparseloco(
  batches, H, topk, chunk, bits, decay, outer_lr=1.0, ef_scale="one", mode="mean_contributors"
):
  """loco-family.md §4, per device row: e ← βe + cΔ (c = 1, or α with ef_scale="outer_lr"); top-k
  per chunk; quantise; e ← e − ê; all workers' ê scatter-averaged; θ_g ← θ_g − α D; θ_r ← θ_g."""
  lr, nbits = outer_lr, bits
  c = {"one": 1.0, "outer_lr": lr}[ef_scale]
  params = toy_params()
  leaves, treedef = jax.tree.flatten(params)
  plans = [compress.plan_chunks(x.shape, D, chunk=chunk, topk=topk) for x in leaves]
  theta, states = [params] * M, [inner_opt().init(params)] * M
  glob = [np.asarray(x, np.float32) for x in leaves]
  ef = [[np.zeros_like(leaf_rows(x)) for x in leaves] for _ in range(M)]
  for s, batch in enumerate(batches):
    inner_steps(theta, states, batch)
    if (s + 1) % H:
      continue
    new_glob = []
    for li, (g, plan) in enumerate(zip(glob, plans, strict=True)):
      step_rows = np.zeros_like(leaf_rows(g))
      for d in range(D):
        sent = []
        for m in range(M):
          delta = leaf_rows(g)[d] - leaf_rows(jax.tree.leaves(theta[m])[li])[d]
          ef[m][li][d] = decay * ef[m][li][d] + c * delta
          tiles = chunks(ef[m][li][d], plan)
          pos = top(tiles, plan.k)
          vals = np.take_along_axis(tiles, pos, -1)
          if nbits != 32:  # one tensor = this leaf's selected values on this device
            vals = quantise(vals.reshape(-1), nbits).reshape(vals.shape)
          dense = np.zeros_like(tiles)
          np.put_along_axis(dense, pos, vals, -1)
          ef[m][li][d] = ef[m][li][d] - unchunks(dense, plan)
          sent.append((pos, vals))
        step_rows[d] = unchunks(scatter_mean(sent, plan.size, mode), plan)
      new_glob.append(g - lr * rows_leaf(step_rows, g.shape))
    glob = new_glob
    theta = [jax.tree.unflatten(treedef, [jnp.asarray(x) for x in glob])] * M
  return jax.tree.unflatten(treedef, glob), ef, plans


def partners(count, seed, sync):
  """loco-family.md §3 / acco_jax.loco.noloco: K permutations from the seed, element j of a
  permutation pairs with element j + M/2; sync t uses randint(fold_in(key(seed), t), 0, K)."""
  rng = np.random.default_rng(seed)
  perms = [rng.permutation(M) for _ in range(count)]
  k = int(jax.random.randint(jax.random.fold_in(jax.random.key(seed), sync), (), 0, count))
  perm, partner = perms[k], np.empty(M, int)
  partner[perm[: M // 2]], partner[perm[M // 2 :]] = perm[M // 2 :], perm[: M // 2]
  return partner


def ref_noloco(batches, H, gamma=0.7, beta=0.5, count=16, seed=0):
  """loco-family.md §3: δ_i ← β δ_i + γ d̄ + γ (φ̄ − φ_i); φ_i ← φ_i + δ_i; θ_i ← φ_i.

  Returns every worker's φ and, per sync, the largest |φ_i − φ_j| over the pairs it formed (the
  size of the consensus term's input: 0 while every pair holds equal slow weights)."""
  params = toy_params()
  treedef = jax.tree.structure(params)
  theta, states = [params] * M, [inner_opt().init(params)] * M
  phi = [np_tree(jax.tree.leaves(params))] * M
  mom = [[np.zeros_like(x) for x in phi[0]] for _ in range(M)]
  gaps = []
  for s, batch in enumerate(batches):
    inner_steps(theta, states, batch)
    if (s + 1) % H:
      continue
    partner = partners(count, seed, (s + 1) // H - 1)
    pairs = [zip(phi[i], phi[partner[i]], strict=True) for i in range(M)]
    gaps.append(max(float(np.abs(a - b).max()) for pair in pairs for a, b in pair))
    th = [np_tree(jax.tree.leaves(t)) for t in theta]
    new_phi = []
    for i in range(M):
      j, out = partner[i], []
      for li in range(len(phi[i])):
        phibar = (phi[i][li] + phi[j][li]) / 2
        dbar = ((th[i][li] - phi[i][li]) + (th[j][li] - phi[j][li])) / 2
        mom[i][li] = beta * mom[i][li] + gamma * dbar + gamma * (phibar - phi[i][li])
        out.append(phi[i][li] + mom[i][li])
      new_phi.append(out)
    phi = new_phi
    theta = [jax.tree.unflatten(treedef, [jnp.asarray(x) for x in p]) for p in phi]
  return [jax.tree.unflatten(treedef, p) for p in phi], gaps


def ref_demo(batches, lr, topk, chunk, decay, wd=0.0, workers=M, devices=D):
  """loco-family.md §5 per device row: m ← βm + ηg; DCT tiles; top-k; m ← m − IDCT(sent); the
  workers' coefficients averaged over contributors; p ← p (1 − ηλ) − η sign(IDCT(mean)). ``lr``:
  η, or one η per step."""
  lrs = list(lr) if np.ndim(lr) else [lr] * len(batches)
  params = toy_params()
  leaves, treedef = jax.tree.flatten(params)
  plans = [
    compress.plan_chunks(x.shape, devices, chunk=chunk, topk=topk, rule="clamped") for x in leaves
  ]
  p = [np.asarray(x, np.float32) for x in leaves]
  mom = [[np.zeros_like(leaf_rows(x, devices)) for x in leaves] for _ in range(workers)]
  for batch, lr in zip(batches, lrs, strict=True):
    tree = jax.tree.unflatten(treedef, [jnp.asarray(x) for x in p])
    grads = []
    for m in range(workers):
      g = np_tree(jax.tree.leaves(worker_grad(tree, batch, m, workers, devices)))
      norm = np.sqrt(sum((x.astype(np.float64) ** 2).sum() for x in g))
      grads.append([x * min(1.0, 1.0 / norm) for x in g])  # clip_by_global_norm(1.0)
    new_p = []
    for li, plan in enumerate(plans):
      update = np.zeros_like(leaf_rows(p[li], devices))
      for d in range(devices):
        sent = []
        for m in range(workers):
          mom[m][li][d] = decay * mom[m][li][d] + lr * leaf_rows(grads[m][li], devices)[d]
          coeffs = dct2(chunks(mom[m][li][d], plan), plan)
          pos = top(coeffs, plan.k)
          vals = np.take_along_axis(coeffs, pos, -1)
          dense = np.zeros_like(coeffs)
          np.put_along_axis(dense, pos, vals, -1)
          mom[m][li][d] = mom[m][li][d] - unchunks(idct2(dense, plan), plan)
          sent.append((pos, vals))
        update[d] = unchunks(idct2(scatter_mean(sent, plan.size), plan), plan)
      u = rows_leaf(update, p[li].shape)
      new_p.append(p[li] * (1 - lr * wd) - lr * np.sign(u))
    p = new_p
  return jax.tree.unflatten(treedef, p), mom
