r"""The SGD forms of ACCO, DPU and SGD on a noisy quadratic, against the theory (pure numpy).

The paper's analysis is of the SGD form of ACCO (``acco-algorithm.md`` §5). With ``g(x)`` an unbiased
estimate of ``∇f(x)`` and the same batch ``B`` per update for every method:

.. math::

  \text{SGD:}\quad & \theta_{t+1} = \theta_t - \eta\, g_B(\theta_t) \\
  \text{ACCO:}\quad & \tilde\theta_{t+1} = \theta_t - \eta\, \tilde g_t, \quad
    \theta_{t+1} = \theta_t - \tfrac{\eta}{2}(g_t + \tilde g_t),
    \quad \tilde g_t = g_{B/2}(\tilde\theta_t),\ g_t = g_{B/2}(\theta_t),\ \tilde\theta_0 = \theta_0 \\
  \text{DPU:}\quad & \theta_{t+1} = \theta_t - \eta\, g_B(\theta_{t-1}), \quad \theta_{-1} = \theta_0

Two checks:

* **Rates, noise-free, one eigenvalue** ``f = ½ λ θ²`` with ``h = ηλ``. Each method is a linear
  recurrence; its asymptotic rate is the spectral radius of its iteration matrix: SGD ``|1 − h|``;
  ACCO ``[[1 − h/2, −h/2], [1, −h]]`` on ``(θ_t, θ̃_t)``, whose eigenvalues are ``1 − h`` (GD's, with
  eigenvector ``θ̃ = θ``) and ``−h/2`` (the estimate's error), so ``ρ = max(|1 − h|, h/2)``: GD's rate
  for ``h ≤ 2/3`` and stable for ``h < 2`` like GD; DPU ``[[1, −h], [1, 0]]`` on ``(θ_t, θ_{t−1})``,
  roots of ``z² − z + h``: ``ρ = √h`` for ``h > 1/4``, divergent for ``h ≥ 1``. The measured per-step
  contraction of simulated runs (envelope of ``|θ_t|``) is compared with these radii.
* **Noisy, ill-conditioned quadratic** ``f(θ) = ½ θᵀ diag(λ) θ`` (``λ`` log-spaced in ``[μ, L]``),
  per-sample gradient noise ``N(0, σ² I)``, batch ``B`` per update (ACCO: two halves of ``B/2``), the
  same noise draws for every method (common random numbers). Sweeps ``ηL`` from small to the
  stability limit; reports ``f − f*`` early (bias phase) and at the end (mean of the last 10% of
  iterations, the noise floor), mean ± std over seeds.

Usage::

  python -m bench.dp.quadratic                    # full sweep; writes bench/results/quadratic.json
  python -m bench.dp.quadratic --small --out /tmp/q.json   # seconds (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

METHODS = ("sgd", "acco", "dpu")
ETA_L = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.95, 1.05, 1.2, 1.5, 1.8, 1.95)
BLOWUP = 1e30  # f − f* above this counts as diverged


# -- theory ----------------------------------------------------------------------------------------


def iteration_matrix(method: str, h: float) -> np.ndarray:
  """The noise-free iteration matrix of ``method`` on ``f = ½ λ θ²`` with ``h = ηλ``."""
  if method == "sgd":
    return np.array([[1.0 - h]])
  if method == "acco":  # state (θ_t, θ̃_t)
    return np.array([[1.0 - h / 2, -h / 2], [1.0, -h]])
  if method == "dpu":  # state (θ_t, θ_{t−1})
    return np.array([[1.0, -h], [1.0, 0.0]])
  raise ValueError(f"unknown method {method!r}")


def spectral_radius(method: str, h: float) -> float:
  return float(np.max(np.abs(np.linalg.eigvals(iteration_matrix(method, h)))))


def stability_limit(method: str, hi: float = 4.0) -> float:
  """The largest ``h`` with spectral radius < 1, by bisection on ``[0, hi]``."""
  lo = 1e-6
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if spectral_radius(method, mid) < 1 else (lo, mid)
  return lo


# -- simulation ------------------------------------------------------------------------------------


def simulate(
  method: str, lam: np.ndarray, eta: np.ndarray, theta0: np.ndarray, noise, steps: int, other0=None
):
  """Runs ``method`` for ``steps`` updates; returns ``f(θ_t) − f*`` for t = 0..steps.

  Args:
    lam: eigenvalues ``[d]``.
    eta: step sizes, broadcastable against ``theta0`` (e.g. ``[E, 1, 1]``).
    theta0: initial points ``[E, S, d]`` (or ``[1, S, d]``).
    noise: ``noise(t) -> (xi1, xi2)``, two half-batch noise draws shaped like ``theta0`` (each with
      the variance of a batch of ``B/2``); SGD and DPU use their mean (a batch of ``B``).
    steps: number of updates.
    other0: ACCO's ``θ̃_0`` / DPU's ``θ_{−1}``; default ``theta0`` (the algorithms' initial condition).
  """
  f = lambda x: 0.5 * np.sum(lam * x * x, axis=-1)
  theta = np.broadcast_to(theta0, np.broadcast_shapes(theta0.shape, eta.shape)).copy()
  other = theta.copy() if other0 is None else np.broadcast_to(other0, theta.shape).copy()
  # other: ACCO's θ̃_t, DPU's θ_{t−1}
  out = [f(theta)]
  with np.errstate(over="ignore", invalid="ignore"):
    for t in range(steps):
      xi1, xi2 = noise(t)
      if method == "sgd":
        theta = theta - eta * (lam * theta + (xi1 + xi2) / 2)
      elif method == "acco":
        g_tilde = lam * other + xi1  # at θ̃_t, first half of the batch
        g = lam * theta + xi2  # at θ_t, second half
        theta, other = theta - eta * (g + g_tilde) / 2, theta - eta * g_tilde
      elif method == "dpu":
        stale = lam * other + (xi1 + xi2) / 2  # gradient at θ_{t−1}
        theta, other = theta - eta * stale, theta
      else:
        raise ValueError(f"unknown method {method!r}")
      theta = np.where(np.isfinite(theta), np.clip(theta, -1e150, 1e150), np.inf)
      other = np.where(np.isfinite(other), np.clip(other, -1e150, 1e150), np.inf)
      out.append(f(theta))
  return np.stack(out)  # [steps + 1, E, S]


def measured_rate(method: str, h: float, steps: int = 600, generic: bool = True) -> float:
  """Per-step contraction of ``|θ_t|`` in a noise-free scalar run, over its second half.

  The window is the second half of the iterations before ``f`` leaves ``[1e-250, 1e250]`` (fast
  contractions underflow, divergent runs overflow); envelopes over 8 steps because DPU's roots are
  complex. ``generic``: start ACCO from ``θ̃_0 = 0 ≠ θ_0`` (DPU from ``θ_{−1} = 0``) so that every
  mode of the iteration is excited. From ``θ̃_0 = θ_0`` noise-free ACCO *is* gradient descent:
  ``g̃_t = g_t`` keeps ``θ̃_t = θ_t`` for ever, on any function, and only the GD mode ``1 − h`` shows.
  """
  lam = np.array([1.0])
  zero = lambda t: (np.zeros((1, 1, 1)), np.zeros((1, 1, 1)))
  other0 = np.zeros((1, 1, 1)) if generic else None
  one = np.ones((1, 1, 1))
  f = simulate(method, lam, np.full((1, 1, 1), h), one, zero, steps, other0)[:, 0, 0]
  env = np.array([f[max(0, t - 8) : t].max() for t in range(1, len(f) + 1)])  # env[t-1] up to t
  outside = np.flatnonzero(~((env > 1e-250) & (env < 1e250)))
  end = int(outside[0]) if outside.size else len(f)
  if end < 24:
    return 0.0 if env[end] < 1 else float("inf")
  t0, t1 = end // 2, end
  a, b = env[t0 - 1], env[t1 - 1]
  return float((b / a) ** (1 / (2 * (t1 - t0))))  # f ∝ θ², so the square root of f's ratio


def noisy_sweep(args) -> dict:
  """Final and early suboptimality per method and ``ηL`` on the noisy quadratic."""
  d, steps, seeds = args.dim, args.steps, args.seeds
  lam = np.geomspace(args.mu, args.L, d)
  eta = np.asarray(args.eta_l, float)[:, None, None] / args.L  # [E, 1, 1]
  rng0 = np.random.default_rng(args.seed)
  theta0 = rng0.normal(size=(1, seeds, d))
  sd_half = args.sigma / np.sqrt(args.batch / 2)
  shape = (len(args.eta_l), seeds, d)

  def make_noise():  # common random numbers: every method reads the same draws in the same order
    rng = np.random.default_rng(args.seed + 1)

    def noise(t):
      xi = rng.normal(size=(2, *shape)) * sd_half
      return xi[0], xi[1]

    return noise

  early_t = max(1, steps // args.early_div)
  tail = max(1, steps // 10)
  out = {"early_step": early_t, "methods": {}}
  for method in METHODS:
    f = simulate(method, lam, eta, theta0, make_noise(), steps)  # [T+1, E, S]
    bad = ~np.isfinite(f) | (f > BLOWUP)
    diverged = bad.any(axis=0)  # [E, S]
    final = np.where(diverged, np.inf, f[-tail:].mean(axis=0))
    early = np.where(bad[early_t], np.inf, f[early_t])
    curve_idx = np.unique(np.geomspace(1, steps, 60).astype(int))
    rows = []
    for i, el in enumerate(args.eta_l):
      ok = ~diverged[i]
      rows.append(
        {
          "eta_l": el,
          "diverged_seeds": int(diverged[i].sum()),
          "final_mean": float(final[i][ok].mean()) if ok.any() else float("inf"),
          "final_std": float(final[i][ok].std(ddof=1)) if ok.sum() > 1 else 0.0,
          "early_mean": float(early[i][ok].mean()) if ok.any() else float("inf"),
          "early_std": float(early[i][ok].std(ddof=1)) if ok.sum() > 1 else 0.0,
          "curve_step": curve_idx.tolist(),
          "curve_mean": [float(v) for v in np.where(bad, np.inf, f)[curve_idx, i].mean(axis=-1)],
        }
      )
    out["methods"][method] = rows
  return out


def run(args) -> dict:
  theory = {
    "stability_limit_h": {m: stability_limit(m) for m in METHODS},
    "rates": [
      {
        "h": el,
        **{f"{m}_theory": spectral_radius(m, el) for m in METHODS},
        **{f"{m}_measured": measured_rate(m, el) for m in METHODS},
        "acco_measured_same_init": measured_rate("acco", el, generic=False),
      }
      for el in args.eta_l
    ],
  }
  setup = {
    k: getattr(args, k)
    for k in ("dim", "mu", "L", "sigma", "batch", "steps", "seeds", "seed", "eta_l")
  }
  return {"setup": setup, "theory": theory, "noisy": noisy_sweep(args)}


def _fmt(mean: float, std: float) -> str:
  return "diverged" if not np.isfinite(mean) else f"{mean:.3g} ± {std:.2g}"


def print_tables(res: dict) -> None:
  lim = res["theory"]["stability_limit_h"]
  print("stability limit of ηL (theory): " + ", ".join(f"{m} {v:.3f}" for m, v in lim.items()))
  print("\n| ηL | " + " | ".join(f"ρ {m} theory / measured" for m in METHODS) + " |")
  print("|---:|" + "---:|" * len(METHODS))
  for r in res["theory"]["rates"]:
    cells = [f"{r[f'{m}_theory']:.4f} / {r[f'{m}_measured']:.4f}" for m in METHODS]
    print(f"| {r['h']} | " + " | ".join(cells) + " |")
  noisy = res["noisy"]
  print(f"\nnoisy quadratic, f − f* at step {noisy['early_step']} | final (mean of last 10%):")
  print("| ηL | " + " | ".join(f"{m} early | {m} final" for m in METHODS) + " |")
  print("|---:|" + "---:|---:|" * len(METHODS))
  for i, el in enumerate(res["setup"]["eta_l"]):
    cells = []
    for m in METHODS:
      r = noisy["methods"][m][i]
      cells += [_fmt(r["early_mean"], r["early_std"]), _fmt(r["final_mean"], r["final_std"])]
    print(f"| {el} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "quadratic.json"
  )
  p.add_argument("--small", action="store_true", help="a few seconds: d=16, 400 steps, 3 seeds")
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--mu", type=float, default=0.01, help="smallest eigenvalue")
  p.add_argument("--L", type=float, default=1.0, help="largest eigenvalue (smoothness)")
  p.add_argument("--sigma", type=float, default=1.0, help="per-sample gradient noise std")
  p.add_argument("--batch", type=int, default=8, help="samples per update (ACCO: two halves)")
  p.add_argument("--steps", type=int, default=3000)
  p.add_argument("--seeds", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--eta-l", dest="eta_l", type=float, nargs="+", default=list(ETA_L))
  p.add_argument("--early-div", type=int, default=30, help="early point = steps // early_div")
  args = p.parse_args(argv)
  if args.small:
    args.dim, args.steps, args.seeds = 16, 400, 3
    args.eta_l = [0.1, 0.5, 1.5]
  res = run(args)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(res, indent=1) + "\n")
  print_tables(res)
  print(f"\nwrote {args.out}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
