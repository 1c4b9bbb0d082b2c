r"""Real reduce-scatter / all-gather times between emulated hosts, and the fitted alpha-beta model.

Each "host" is one JAX process with one CPU device in its own network namespace; hosts are joined by
veth links whose egress is shaped with ``tc tbf`` (both ends), the recipe of ``environment.md`` §9:
two hosts share one veth pair; more hosts hang off a bridge in a switch namespace (each host link
shaped at both of its ends, like one NIC per host). The processes form a ``jax.distributed`` job
(gloo, coordinator on host 0's veth address), and time ``psum_scatter`` / ``all_gather``
(``shard_map``, fp32) of a flat buffer of several sizes at several link rates. Then, per rate, a
least-squares fit (on relative errors, :math:`\alpha \ge 0`) of :mod:`acco_jax.analysis.perfmodel`'s ring
model

.. math::

  T = (n - 1)\,\alpha + \frac{n-1}{n}\,\frac{M}{\beta}

over every size and host count, per collective and for both together; and one fit per collective
over all rates, :math:`1/\beta = 1/(\eta \cdot \text{rate}) + 1/\beta_{cpu}` (link efficiency
:math:`\eta` in series with what the host itself sustains).

The token bucket defaults to 32 KB instead of the recipe's 256 KB: a 256 KB bucket lets a quarter of
a 1 MiB transfer through at full speed (goodput above the shaped rate). Needs root (``ip netns``,
``tc``). Everything it creates is named ``acco_*`` (namespaces ``acco_h<i>`` / ``acco_sw``, links
``acco_*``, ``/etc/netns/acco_*``), uses only 10.77.0.0/24 inside its own links, and is removed on
exit; leftovers of a crashed run are removed at start.

Usage::

  sudo python -m bench.net.netns                # 2 and 4 hosts; 100, 400, 1000 Mbit + unshaped; 5 reps
  sudo python -m bench.net.netns --hosts 2 --mbit 400 --sizes-mb 1 4 --reps 2   # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common

PREFIX = "acco_"
SUBNET = "10.77.0"
PORT = 23456
ETC = Path("/etc/netns")
_CREATED_ETC = []  # whether this run created /etc/netns (then it removes it when empty)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, check=check, capture_output=True, text=True)


def netns_ok() -> str | None:
  """None if namespaces and tc can be used, else the reason."""
  if os.geteuid() != 0:
    return "needs root (ip netns, tc)"
  for tool in (["ip", "netns", "list"], ["tc", "-V"]):
    try:
      sh(*tool)
    except (OSError, subprocess.CalledProcessError) as e:
      return f"`{' '.join(tool)}` failed: {e}"
  return None


def cleanup() -> None:
  """Removes every namespace, root-namespace link and /etc/netns entry named acco_*."""
  names = [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line]
  for ns in names:
    if ns.startswith(PREFIX):
      sh("ip", "netns", "del", ns, check=False)
  for line in sh("ip", "-o", "link", "show").stdout.splitlines():
    name = line.split(":")[1].strip().split("@")[0]
    if name.startswith(PREFIX):
      sh("ip", "link", "del", name, check=False)
  if ETC.is_dir():
    for d in ETC.glob(PREFIX + "*"):
      for f in d.iterdir():
        f.unlink()
      d.rmdir()
    if _CREATED_ETC and not any(ETC.iterdir()):
      ETC.rmdir()


def setup(hosts: int) -> list[tuple[str, str]]:
  """Creates the namespaces and links; returns every shaped end as ``(namespace, device)``."""
  hostname = socket.gethostname()
  shaped = []
  if not ETC.exists():
    _CREATED_ETC.append(True)
  for i in range(hosts):
    ns = f"{PREFIX}h{i}"
    sh("ip", "netns", "add", ns)
    sh("ip", "-n", ns, "link", "set", "lo", "up")
    Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
    Path(f"/etc/netns/{ns}/hosts").write_text(f"127.0.0.1 localhost\n{SUBNET}.{i + 1} {hostname}\n")
  if hosts == 2:  # environment.md §9: one veth pair, both ends shaped
    sh("ip", "link", "add", f"{PREFIX}v0", "type", "veth", "peer", "name", f"{PREFIX}v1")
    for i in range(2):
      ns, dev = f"{PREFIX}h{i}", f"{PREFIX}v{i}"
      sh("ip", "link", "set", dev, "netns", ns)
      sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", dev)
      sh("ip", "-n", ns, "link", "set", dev, "up")
      shaped.append((ns, dev))
    return shaped
  sw = f"{PREFIX}sw"
  sh("ip", "netns", "add", sw)
  sh("ip", "-n", sw, "link", "add", f"{PREFIX}br", "type", "bridge")
  sh("ip", "-n", sw, "link", "set", f"{PREFIX}br", "up")
  for i in range(hosts):
    ns, dev, port = f"{PREFIX}h{i}", f"{PREFIX}e{i}", f"{PREFIX}p{i}"
    sh("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
    sh("ip", "link", "set", dev, "netns", ns)
    sh("ip", "link", "set", port, "netns", sw)
    sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", dev)
    sh("ip", "-n", ns, "link", "set", dev, "up")
    sh("ip", "-n", sw, "link", "set", port, "master", f"{PREFIX}br")
    sh("ip", "-n", sw, "link", "set", port, "up")
    shaped += [(ns, dev), (sw, port)]
  return shaped


def shape(shaped: list[tuple[str, str]], mbit: float, burst: str = "32kb") -> None:
  """tbf on every end (egress); ``mbit <= 0`` removes the shaping."""
  for ns, dev in shaped:
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
    if mbit > 0:
      sh(
        "ip",
        "netns",
        "exec",
        ns,
        "tc",
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{mbit}mbit",
        "burst",
        burst,
        "latency",
        "50ms",
      )


def run_hosts(hosts: int, args, timeout: float) -> dict:
  """Starts one worker per host namespace; returns process 0's measurements."""
  with tempfile.TemporaryDirectory(prefix=PREFIX) as tmp:
    out = Path(tmp) / "result.json"
    env = common.cpu_env(1)  # this checkout first on PYTHONPATH
    procs, logs = [], []
    try:
      for i in range(hosts):
        log = open(Path(tmp) / f"h{i}.log", "w+")
        logs.append(log)
        cmd = [
          "ip",
          "netns",
          "exec",
          f"{PREFIX}h{i}",
          *common.module_command(__spec__.name),
          "--worker",
          str(out),
          "--process-id",
          str(i),
          "--num-processes",
          str(hosts),
          "--sizes-mb",
          *map(str, args.sizes_mb),
          "--reps",
          str(args.reps),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
      deadline = time.monotonic() + timeout
      for p in procs:
        p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      pass
    finally:
      for p in procs:  # only the processes started here
        if p.poll() is None:
          p.kill()
          p.wait(timeout=10)
      tails = []
      for i, log in enumerate(logs):
        log.seek(0)
        tails.append(f"--- host {i}\n" + log.read()[-1500:])
        log.close()
    if any(p.returncode != 0 for p in procs) or not out.exists():
      raise RuntimeError(
        f"{hosts}-host run failed: {[p.returncode for p in procs]}\n" + "\n".join(tails)
      )
    return json.loads(out.read_text())


def worker(args) -> int:
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"{SUBNET}.1:{PORT}",
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=60,
  )
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  n = jax.device_count()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  rowwise = NamedSharding(mesh, P("data"))

  def smap(f):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data")))

  rs = smap(lambda v: lax.psum_scatter(v[0], "data", tiled=True)[None])
  ag = smap(lambda v: lax.all_gather(v[0], "data", tiled=True)[None])
  barrier = smap(lambda v: lax.psum(v, "data"))
  token = jax.make_array_from_process_local_data(rowwise, np.ones((1, 1), np.float32))
  results = []
  try:
    for mb in args.sizes_mb:
      count = int(mb * 2**20) // 4 // n * n  # f32 values in the full buffer
      full = jax.make_array_from_process_local_data(rowwise, np.ones((1, count), np.float32))
      part = jax.make_array_from_process_local_data(rowwise, np.ones((1, count // n), np.float32))
      for kind, fn, x in (("reduce_scatter", rs, full), ("all_gather", ag, part)):
        compiled = fn.lower(x).compile()
        times = []
        for _ in range(args.reps):
          barrier(token).block_until_ready()
          t0 = time.perf_counter()
          compiled(x).block_until_ready()
          times.append(time.perf_counter() - t0)
        results.append({"kind": kind, "bytes": count * 4, "times": times})
        if jax.process_index() == 0:
          print(f"{kind} {count * 4 / 1e6:.1f} MB: {min(times):.3f} s", flush=True)
    if jax.process_index() == 0:
      Path(args.worker).write_text(json.dumps({"hosts": n, "results": results}))
  finally:
    jax.distributed.shutdown()
  del jnp
  return 0


def _nnls_fit(X, t) -> tuple:
  """Non-negative least squares on relative errors (rows divided by t): coef, R², residuals."""
  import numpy as np
  from scipy.optimize import nnls

  X, t = np.asarray(X, float), np.asarray(t, float)
  coef, _ = nnls(X / t[:, None], np.ones_like(t))
  pred = X @ coef
  r2 = 1 - float(np.sum((t - pred) ** 2) / np.sum((t - t.mean()) ** 2))
  rel = np.abs(pred / t - 1)
  return coef, r2, float(np.max(rel)), float(np.median(rel))


def fit(points: list[dict]) -> dict:
  """t = (n−1) α + (n−1)/n · M / β: α ≥ 0 and β by least squares on relative errors."""
  X = [[p["n"] - 1, (p["n"] - 1) / p["n"] * p["bytes"]] for p in points]
  coef, r2, worst, med = _nnls_fit(X, [p["t"] for p in points])
  return {
    "alpha_s": float(coef[0]),
    "beta_Bps": float(1 / coef[1]) if coef[1] > 0 else None,
    "r2": r2,
    "max_rel_residual": worst,
    "median_rel_residual": med,
    "points": len(points),
  }


def fit_link_and_cpu(points: list[dict]) -> dict:
  """Over every rate (unshaped too): t = (n−1) α + (n−1)/n · M · (1/(η·rate) + 1/β_cpu).

  η: share of the shaped rate the collective gets; β_cpu: the bandwidth at which the host itself
  (gloo's copies and reductions, on a 2-core machine) limits it, in series with the link.
  """
  X = []
  for p in points:
    sent = (p["n"] - 1) / p["n"] * p["bytes"]
    rate = p["mbit"] * 1e6 / 8 if p["mbit"] else float("inf")  # unshaped: no link term
    X.append([p["n"] - 1, sent / rate, sent])
  coef, r2, worst, med = _nnls_fit(X, [p["t"] for p in points])
  return {
    "alpha_s": float(coef[0]),
    "efficiency": float(1 / coef[1]) if coef[1] > 0 else None,
    "cpu_Bps": float(1 / coef[2]) if coef[2] > 0 else None,
    "r2": r2,
    "max_rel_residual": worst,
    "median_rel_residual": med,
    "points": len(points),
  }


def report(runs: list[dict], rates) -> dict:
  """Prints the measurements and the fits; returns the fits."""
  table, fits, rows = [], {}, []
  for r in runs:
    sent = (r["n"] - 1) / r["n"] * r["bytes"]
    table.append(
      {
        "n": r["n"],
        "rate": f"{r['mbit']:g}" if r["mbit"] else "unshaped",
        "kind": r["kind"],
        "MB": f"{r['bytes'] / 2**20:g}",
        "t": f"{r['t']:.3f}",
        "spread": f"{max(r['times']) / min(r['times']):.2f}",
        "goodput": f"{sent * 8 / r['t'] / 1e6:.0f}",
      }
    )
  print(
    common.format_table(
      table,
      [
        ("n", "hosts"),
        ("rate", "Mbit/s"),
        ("kind", "collective"),
        ("MB", "buffer MiB"),
        ("t", "min s"),
        ("spread", "max/min"),
        ("goodput", "sent Mbit/s"),
      ],
    )
  )
  pct = lambda x: f"{100 * x:.0f}%"
  for kind in ("reduce_scatter", "all_gather", "both"):
    for mbit in rates:
      pts = [r for r in runs if r["mbit"] == mbit and kind in (r["kind"], "both")]
      if not pts:
        continue
      f = fit(pts)
      fits[f"{kind}@{mbit:g}"] = f
      eff = f["beta_Bps"] * 8 / (mbit * 1e6) if mbit and f["beta_Bps"] else None
      rows.append(
        {
          "kind": kind,
          "rate": f"{mbit:g}" if mbit else "unshaped",
          "alpha": f"{1e3 * f['alpha_s']:.2f}",
          "beta": f"{f['beta_Bps'] * 8 / 1e6:.0f}" if f["beta_Bps"] else "-",
          "eff": f"{eff:.2f}" if eff else "-",
          "r2": f"{f['r2']:.3f}",
          "med": pct(f["median_rel_residual"]),
          "res": pct(f["max_rel_residual"]),
          "pts": f["points"],
        }
      )
  print(
    "\nFitted T = (n-1) α + (n-1)/n · M / β per rate (least squares on relative error, α ≥ 0)\n"
  )
  print(
    common.format_table(
      rows,
      [
        ("kind", "collective"),
        ("rate", "rate Mbit/s"),
        ("alpha", "α ms/hop"),
        ("beta", "β Mbit/s"),
        ("eff", "β/rate"),
        ("r2", "R²"),
        ("med", "median |resid|"),
        ("res", "max |resid|"),
        ("pts", "points"),
      ],
    )
  )
  rows = []
  for kind in ("reduce_scatter", "all_gather", "both"):
    pts = [r for r in runs if kind in (r["kind"], "both")]
    g = fit_link_and_cpu(pts)
    fits[f"{kind}@link+cpu"] = g
    rows.append(
      {
        "kind": kind,
        "alpha": f"{1e3 * g['alpha_s']:.2f}",
        "eff": f"{g['efficiency']:.2f}" if g["efficiency"] else "-",
        "cpu": f"{g['cpu_Bps'] * 8 / 1e6:.0f}" if g["cpu_Bps"] else "∞",
        "r2": f"{g['r2']:.3f}",
        "med": pct(g["median_rel_residual"]),
        "res": pct(g["max_rel_residual"]),
        "pts": g["points"],
      }
    )
  print("\nOne fit over all rates: T = (n-1) α + (n-1)/n · M · (1/(η·rate) + 1/β_cpu)\n")
  print(
    common.format_table(
      rows,
      [
        ("kind", "collective"),
        ("alpha", "α ms/hop"),
        ("eff", "η"),
        ("cpu", "β_cpu Mbit/s"),
        ("r2", "R²"),
        ("med", "median |resid|"),
        ("res", "max |resid|"),
        ("pts", "points"),
      ],
    )
  )
  return fits


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
  ap.add_argument("--num-processes", type=int, default=2, help=argparse.SUPPRESS)
  ap.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
  ap.add_argument(
    "--mbit",
    type=float,
    nargs="+",
    default=[100, 400, 1000, 0],
    help="link rates in Mbit/s; 0 = unshaped (reported, not fitted)",
  )
  ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64])
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--burst", default="32kb", help="tbf bucket (environment.md §9: 256kb)")
  ap.add_argument("--timeout", type=float, default=900, help="seconds per (hosts, rate) run")
  ap.add_argument("--out", default=str(common.RESULTS / "netns.json"))
  ap.add_argument("--refit", help="recompute the fits of a previous --out JSON (no measurement)")
  args = ap.parse_args(argv)
  if args.worker:
    return worker(args)
  if args.refit:
    data = json.loads(Path(args.refit).read_text())
    data["fits"] = report(data["runs"], data["args"]["mbit"])
    print(f"\nwrote {common.write_json(Path(args.out), data)}")
    return 0

  why = netns_ok()
  if why:
    print(f"netns benchmark skipped: {why}")
    return 0
  runs = []
  t_start = time.perf_counter()
  cleanup()  # leftovers of a crashed run
  try:
    for hosts in args.hosts:
      shaped = setup(hosts)
      try:
        for mbit in args.mbit:
          shape(shaped, mbit, args.burst)
          t0 = time.perf_counter()
          res = run_hosts(hosts, args, args.timeout)
          for r in res["results"]:
            runs.append(
              {
                "n": hosts,
                "mbit": mbit,
                "kind": r["kind"],
                "bytes": r["bytes"],
                "t": min(r["times"]),
                "times": r["times"],
              }
            )
          common.log(f"{hosts} hosts @ {mbit or 'unshaped'} Mbit: {time.perf_counter() - t0:.0f} s")
      finally:
        cleanup()
  finally:
    cleanup()

  fits = report(runs, args.mbit)
  data = {
    "machine": common.machine(),
    "args": vars(args),
    "runs": runs,
    "fits": fits,
    "elapsed_s": time.perf_counter() - t_start,
  }
  print(f"\nwrote {common.write_json(Path(args.out), data)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
