r"""The pipeline simulator against an emulated network: measured vs predicted iteration times.

One ``train.py`` process (one CPU device, gloo, ``jax.distributed``) per node of a topology JSON
file (format in :mod:`acco_jax.skippipe.topology`), each in its own network namespace. The
namespaces hang off a bridge (``bench/net/netns.py``'s helpers); each node's egress is shaped per
destination, so every ordered pair ``(i, j)`` gets the file's rate (and, where the kernel has netem,
its one-way latency):

  tc qdisc add dev D root handle 1: htb                   # unclassified (ARP): unshaped
  tc class add dev D parent 1: classid 1:<j+1> htb rate <bw_ij>mbit ceil <bw_ij>mbit burst 16kb
  tc qdisc add dev D parent 1:<j+1> handle <j+10>: netem delay <lat_ij>ms limit 10000  # netem only
  tc filter add dev D parent 1: protocol ip prio 1 u32 match ip dst <ip of j>/32 flowid 1:<j+1>

This machine's kernel has no netem (nor prio, fq: ``CONFIG_NET_SCH_NETEM`` is not set), so only
rates are shaped here, and a topology whose latencies exceed the veth's own (0.1 ms) is refused: the
topology file's links differ by bandwidth (two regions, 1 Gbit/s inside, 50 Mbit/s between them).
TCP's slow start after idle is off in every namespace (``net.ipv4.tcp_slow_start_after_idle=0``):
the pipeline's bursts are separated by idle gaps, and a window reset on every burst would price
each transfer several round trips. The shaping is checked before the runs: a TCP connect (one
round trip) and a 1 MiB send between a pair inside a region and a pair across regions.

The pipeline runs ``pipeline.stages = M`` (node ``s`` holds stage ``s``, one data lane) with each
schedule of :data:`SCHEDULES`, one after the other in one invocation (the machine is shared: compare
them side by side). A schedule's time per update is the mean interval between the logged updates
after ``--skip`` (compilation and warm-up). Its prediction is the simulator's for the same topology
and for the same paths (``acco_jax.pipeline.build.schedule_paths``), with costs measured here:

* per-stage compute: one namespace-free process with the same flags (one CPU device, XLA single
  threaded) jit-compiles a stage's operations as ``pipeline/step.py`` runs them (F0 = embedding and
  stage 0's blocks, F, H = head and loss forward and backward, B = a stage's backward recomputed from
  its input) and times each (median of ``--cost-reps``); ``fwd_S = [F0, F, ...]``,
  ``backward = B / F``, ``head = H / (1 + backward)``, ``act_bytes = B x L x D x 2`` (bf16);
* ``sim``: ``simulate.simulate`` under the schedule's policy (gpipe, 1f1b);
* ``replay``: ``simulate.replay`` of the order in which the runtime's tick table runs each stage's
  operations (the runtime is a static schedule: each device runs its ticks in order and waits only
  for what it receives);
* ``sync``: added to both, the end of an update outside the pipeline: the shared parameters'
  gradient (embedding, positions, final LayerNorm; float32) is summed over the stages, a ring
  all-reduce over the nodes in rank order (``simulate.ring_allreduce_s``).

Needs root (``ip netns``, ``tc``). Namespaces and links are ``bench/net/netns.py``'s ``acco_*`` ones,
removed at start (leftovers of a crashed run), after the runs and on failure.

Usage (root)::

  python -m bench.net.skippipe_netns                                 # 3 schedules, 24 updates each
  python -m bench.net.skippipe_netns --schedules 1f1b --updates 12   # quick check
  python -m bench.net.skippipe_netns --dry-run                       # tc commands and predictions only
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from acco_jax.skippipe import topology as topology_lib
from bench import common
from bench.net import netns, skippipe_prediction

TOPOLOGY = common.REPO / "bench" / "topologies" / "two_regions_4.json"
RUNS = common.RESULTS / "runs" / "skippipe_netns"
CACHE = common.REPO / ".pytest_cache" / "acco_data"
PROBE_PORT = 23999
BURST = "16kb"  # htb's bucket per class: about 10 packets beyond the rate
VETH_GBPS = 10.0  # what an unshaped veth pair is taken to carry (the control runs' topology)
UNSHAPED_LATENCY_MS = 0.1  # the most a topology may ask of a link that is not delayed (no netem)
# Every process single-threaded: 4 processes share the machine's 2 cores, and a stage's cost is
# measured under the same flags.
XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"

# The measured schedules: name -> config overrides on configs/gpt2_pipeline.py. The prediction
# reads pipeline.schedule (and the path settings) from the same overrides, so a new schedule is one
# more entry here.
SCHEDULES = {
  "gpipe": {"pipeline.schedule": "gpipe"},
  "1f1b": {"pipeline.schedule": "1f1b"},
  "skippipe": {"pipeline.schedule": "skippipe", "pipeline.paths": "random"},
  # the path scheduler's plan for this topology (pipeline.topology: the same JSON file)
  "scheduled": {
    "pipeline.schedule": "skippipe",
    "pipeline.paths": "scheduled",
    "pipeline.topology": str(TOPOLOGY),
  },
}


def tc_commands(
  topo: topology_lib.Topology, node: int, dev: str, netem: bool = False
) -> list[list[str]]:
  """The ``tc`` commands that shape ``node``'s egress on ``dev`` toward every other node.

  An htb class ``1:<j+1>`` per destination ``j`` at the pair's rate, chosen by a u32 filter on
  ``j``'s address; unmatched traffic (ARP) leaves unshaped. With ``netem`` each class gets a netem
  leaf with the pair's one-way latency; without it (this machine's kernel has no netem), a topology
  whose latencies exceed :data:`UNSHAPED_LATENCY_MS` is refused: they could not be emulated.
  """
  m = topo.num_nodes
  off = [j for j in range(m) if j != node]
  worst = max((topo.latency_MxM[node, j] * 1e3 for j in off), default=0.0)
  if not netem and worst > UNSHAPED_LATENCY_MS:
    raise ValueError(
      f"node {node} has a {worst:g} ms link but without netem only the rate is shaped: lower the "
      f"topology's latencies to <= {UNSHAPED_LATENCY_MS} ms (the veth's own), or use a kernel "
      "with sch_netem"
    )
  cmds = [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"]]
  for j in off:
    rate = f"{topo.bandwidth_MxM[node, j] * 8 / 1e6:g}mbit"
    cls = f"1:{j + 1}"
    cmds.append(
      [
        "tc",
        "class",
        "add",
        "dev",
        dev,
        "parent",
        "1:",
        "classid",
        cls,
        "htb",
        "rate",
        rate,
        "ceil",
        rate,
        "burst",
        BURST,
      ]
    )
    if netem:
      delay = f"{topo.latency_MxM[node, j] * 1e3:g}ms"
      cmds.append(
        [
          "tc",
          "qdisc",
          "add",
          "dev",
          dev,
          "parent",
          cls,
          "handle",
          f"{j + 10}:",
          "netem",
          "delay",
          delay,
          "limit",
          "10000",
        ]
      )
    cmds.append(
      [
        "tc",
        "filter",
        "add",
        "dev",
        dev,
        "parent",
        "1:",
        "protocol",
        "ip",
        "prio",
        "1",
        "u32",
        "match",
        "ip",
        "dst",
        f"{address(j)}/32",
        "flowid",
        cls,
      ]
    )
  return cmds


def has_netem() -> bool:
  """Whether this kernel has the netem qdisc (``/proc/config.gz``; assumed present if unreadable)."""
  try:
    import gzip

    with gzip.open("/proc/config.gz", "rt") as f:
      text = f.read()
  except OSError:
    return True
  return "CONFIG_NET_SCH_NETEM=y" in text or "CONFIG_NET_SCH_NETEM=m" in text


def address(node: int) -> str:
  """Node ``node``'s address on the bridge (``bench/net/netns.py``'s numbering)."""
  return f"{netns.SUBNET}.{node + 1}"


def shape(topo: topology_lib.Topology, netem: bool) -> None:
  """Namespaces on a bridge, every node's egress shaped per destination, slow start after idle off."""
  netns.setup(topo.num_nodes)
  for i in range(topo.num_nodes):
    ns = f"{netns.PREFIX}h{i}"
    netns.sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
    for cmd in tc_commands(topo, i, f"{netns.PREFIX}e{i}", netem):
      netns.sh("ip", "netns", "exec", ns, *cmd)


# -- checking the shaping ---------------------------------------------------------------------------


def probe_server(num_bytes: int) -> None:
  """Accepts one connection per transfer: reads ``num_bytes`` and answers one byte (twice)."""
  with socket.create_server(("0.0.0.0", PROBE_PORT)) as srv:
    conn, _ = srv.accept()
    with conn:
      for _ in range(2):  # a warm-up transfer (opens the window), then the timed one
        left = num_bytes
        while left:
          left -= len(conn.recv(min(left, 1 << 20)))
        conn.sendall(b"k")


def probe_client(host: str, num_bytes: int) -> dict:
  """One round trip (TCP connect) and the time to send ``num_bytes`` and get the answer."""
  payload = b"x" * num_bytes
  for _ in range(100):
    try:
      t0 = time.perf_counter()
      conn = socket.create_connection((host, PROBE_PORT), timeout=10)
      rtt = time.perf_counter() - t0
      break
    except OSError:
      time.sleep(0.05)
  with conn:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(2):
      t0 = time.perf_counter()
      conn.sendall(payload)
      conn.recv(1)
      times.append(time.perf_counter() - t0)
  return {"rtt_s": rtt, "send_s": times[-1]}


def check_pair(topo, src: int, dst: int, num_bytes: int = 1 << 20) -> dict:
  """Measured vs expected round trip and 1 MiB send from ``src`` to ``dst``."""
  me, env = common.module_command(__spec__.name), common.child_env()
  server = subprocess.Popen(
    ["ip", "netns", "exec", f"{netns.PREFIX}h{dst}", *me, "--probe-server", str(num_bytes)], env=env
  )
  try:
    out = subprocess.run(
      [
        "ip",
        "netns",
        "exec",
        f"{netns.PREFIX}h{src}",
        *me,
        "--probe-client",
        address(dst),
        str(num_bytes),
      ],
      check=True,
      capture_output=True,
      text=True,
      timeout=60,
      env=env,
    ).stdout
  finally:
    server.wait(timeout=10)
  got = json.loads(out)
  rtt = topo.latency_MxM[src, dst] + topo.latency_MxM[dst, src]
  send = topo.latency_MxM[src, dst] + num_bytes / topo.bandwidth_MxM[src, dst]
  send += topo.latency_MxM[dst, src]  # the one-byte answer
  return {
    "pair": [src, dst],
    **got,
    "rtt_expected_s": rtt,
    "send_expected_s": send,
    "goodput_mbit": num_bytes * 8 / 1e6 / max(got["send_s"] - got["rtt_s"], 1e-9),
  }


# -- runs -----------------------------------------------------------------------------------------


def worker_env() -> dict:
  return dict(common.child_env(), JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_FLAGS, PYTHONUNBUFFERED="1")


def train_command(name: str, node: int, nodes: int, workdir: Path, args) -> list[str]:
  settings = {
    **skippipe_prediction.MODEL,
    **SCHEDULES[name],
    "data.cache_dir": str(args.cache),
    "mesh.cpu_devices": 1,
    "dist.coordinator_address": f"{address(0)}:{netns.PORT}",
    "dist.num_processes": nodes,
    "dist.process_id": node,
    "train.num_updates": args.updates,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.eval_batches": 1,
    "train.sample_tokens": 0,
    "ckpt.every": 0,
    "ckpt.async_save": False,
    "opt.warmup_updates": 2,
  }
  return [
    "ip",
    "netns",
    "exec",
    f"{netns.PREFIX}h{node}",
    sys.executable,
    str(common.REPO / "train.py"),
    f"--config={common.REPO}/configs/gpt2_pipeline.py:tiny",
    f"--workdir={workdir}",
    *[f"--config.{k}={v}" for k, v in settings.items()],
  ]


def seconds_per_update(metrics: Path, skip: int) -> tuple[float, list[float]]:
  """Mean interval between the logged updates after ``skip``, and every interval."""
  rows = [json.loads(x) for x in metrics.read_text().splitlines()]
  wall = {r["update"]: r["wall_s"] for r in rows if "loss" in r and "wall_s" in r}
  ups = sorted(u for u in wall if u >= skip)
  gaps = [wall[b] - wall[a] for a, b in zip(ups, ups[1:], strict=False)]
  return (wall[ups[-1]] - wall[ups[0]]) / (ups[-1] - ups[0]), gaps


def unshaped(topo: topology_lib.Topology) -> topology_lib.Topology:
  """``topo`` with every link at the veth's own speed (about 10 Gbit/s): the control runs."""
  import dataclasses

  import numpy as np

  bw = np.where(np.isinf(topo.bandwidth_MxM), np.inf, VETH_GBPS * topology_lib.GBIT)
  return dataclasses.replace(topo, name=topo.name + " unshaped", bandwidth_MxM=bw)


def run_schedule(name: str, network: str, nodes: int, args) -> dict:
  workdir = RUNS / f"{name}_{network}"
  subprocess.run(["rm", "-rf", str(workdir)], check=True)
  workdir.mkdir(parents=True)
  procs = []
  t0 = time.time()
  try:
    for i in range(nodes):
      log = open(workdir / f"process{i}.log", "w")
      procs.append(
        subprocess.Popen(
          train_command(name, i, nodes, workdir, args),
          env=worker_env(),
          stdout=log,
          stderr=subprocess.STDOUT,
        )
      )
    codes = [p.wait(timeout=args.timeout) for p in procs]
  finally:
    for p in procs:  # only the processes started here
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)
  if any(codes):
    raise RuntimeError(f"{name}: {codes}\n{(workdir / 'process0.log').read_text()[-2000:]}")
  mean, gaps = seconds_per_update(workdir / "metrics.jsonl", args.skip)
  return {"process_s": time.time() - t0, "s_per_update": mean, "intervals_s": gaps}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--probe-server", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--probe-client", nargs=2, help=argparse.SUPPRESS)
  ap.add_argument("--costs-only", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--topology", type=Path, default=TOPOLOGY)
  ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
  ap.add_argument(
    "--networks",
    nargs="+",
    default=["shaped", "unshaped"],
    choices=["shaped", "unshaped"],
    help="unshaped: the control, no tc",
  )
  ap.add_argument("--updates", type=int, default=24)
  ap.add_argument("--skip", type=int, default=4, help="updates left out of the timing")
  ap.add_argument("--cost-reps", type=int, default=50)
  ap.add_argument("--cache", type=Path, default=CACHE, help="data.cache_dir (tokenized corpus)")
  ap.add_argument("--timeout", type=float, default=900, help="seconds per schedule's run")
  ap.add_argument("--dry-run", action="store_true", help="print tc commands and predictions only")
  ap.add_argument("--out", type=Path, default=common.RESULTS / "skippipe_netns.json")
  args = ap.parse_args(argv)
  if args.probe_server:
    probe_server(args.probe_server)
    return 0
  if args.probe_client:
    print(json.dumps(probe_client(args.probe_client[0], int(args.probe_client[1]))))
    return 0
  if args.costs_only:
    print(json.dumps(skippipe_prediction.measure_costs({}, args.cost_reps)))
    return 0
  topo = topology_lib.load(str(args.topology))
  nodes = int(skippipe_prediction.MODEL["pipeline.stages"])
  if topo.num_nodes != nodes:
    raise SystemExit(f"{args.topology} has {topo.num_nodes} nodes; this benchmark needs {nodes}")
  cmd = common.module_command(__spec__.name, "--costs-only", "--cost-reps", str(args.cost_reps))
  run = subprocess.run(cmd, env=worker_env(), check=True, capture_output=True, text=True)
  measured = json.loads(run.stdout)
  common.log(f"stage costs (s): {json.dumps(measured['op_s'])}")
  netem = has_netem()
  topos = {"shaped": topo, "unshaped": unshaped(topo)}
  preds = {
    (name, net): skippipe_prediction.predict(topos[net], measured, SCHEDULES[name])
    for net in args.networks
    for name in args.schedules
  }
  if args.dry_run:
    for i in range(nodes):
      for cmd in tc_commands(topo, i, f"{netns.PREFIX}e{i}", netem):
        print(" ".join(cmd))
    print(json.dumps({f"{k[0]}@{k[1]}": v for k, v in preds.items()}, indent=1))
    return 0
  why = netns.netns_ok()
  if why:
    print(f"skipped: {why}")
    return 0
  checks, results = [], {}
  netns.cleanup()
  try:
    shape(topo, netem)
    far = next(j for j in range(nodes) if topo.region_M[j] != topo.region_M[0])
    near = next(j for j in range(1, nodes) if topo.region_M[j] == topo.region_M[0])
    for pair in ((0, near), (0, far)):
      checks.append(check_pair(topo, *pair))
      c = checks[-1]
      common.log(
        f"link {pair}: rtt {c['rtt_s'] * 1e3:.1f} ms (expected {c['rtt_expected_s'] * 1e3:.1f}),"
        f" 1 MiB {c['send_s'] * 1e3:.0f} ms (expected {c['send_expected_s'] * 1e3:.0f})"
      )
    for net in args.networks:
      for i in range(nodes):  # the control: shaping removed
        if net == "unshaped":
          netns.sh(
            "ip",
            "netns",
            "exec",
            f"{netns.PREFIX}h{i}",
            "tc",
            "qdisc",
            "del",
            "dev",
            f"{netns.PREFIX}e{i}",
            "root",
            check=False,
          )
      for name in args.schedules:
        r = {"schedule": name, "network": net, **run_schedule(name, net, nodes, args)}
        results[f"{name}@{net}"] = {**r, **preds[name, net]}
        common.log(f"{name} {net}: {r['s_per_update']:.3f} s/update")
  finally:
    netns.cleanup()
  rows = []
  for r in results.values():
    r["measured_over_sim"] = r["s_per_update"] / r["sim_s"]
    r["measured_over_replay"] = r["s_per_update"] / r["replay_s"]
    rows.append(
      {
        "name": r["schedule"],
        "net": r["network"],
        "meas": f"{r['s_per_update']:.3f}",
        "sim": f"{r['sim_s']:.3f}",
        "rs": f"{r['measured_over_sim']:.2f}",
        "rep": f"{r['replay_s']:.3f}",
        "rr": f"{r['measured_over_replay']:.2f}",
        "sync": f"{r['sync_s']:.3f}",
      }
    )
  print(
    common.format_table(
      rows,
      [
        ("name", "schedule"),
        ("net", "network"),
        ("meas", "measured s/update"),
        ("sim", "simulated s"),
        ("rs", "measured/sim"),
        ("rep", "replayed ticks s"),
        ("rr", "measured/replay"),
        ("sync", "of which sync s"),
      ],
    )
  )
  data = {
    "machine": common.machine(),
    "topology": str(args.topology),
    "model": skippipe_prediction.MODEL,
    "costs": measured,
    "link_checks": checks,
    "runs": results,
    "args": {k: str(v) for k, v in vars(args).items()},
  }
  print(f"wrote {common.write_json(args.out, data)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
