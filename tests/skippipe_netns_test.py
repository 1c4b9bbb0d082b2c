"""bench/net/skippipe_netns.py without root: the tc commands for its topology file, the runtime's tick
order replayed by the simulator, and the predictions it prints next to the measurements."""

import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"

from acco_jax.pipeline import ticks  # noqa: E402
from acco_jax.skippipe import paths as paths_lib  # noqa: E402
from acco_jax.skippipe import simulate  # noqa: E402
from acco_jax.skippipe import topology as topology_lib  # noqa: E402
from bench.net import skippipe_netns as sn  # noqa: E402
from bench.net import skippipe_prediction as sp  # noqa: E402

# Stage costs of the order of the ones measured on this machine (seconds, bytes).
MEASURED = {
  "op_s": {"F0": 0.012, "F": 0.01, "H": 0.003, "B": 0.04, "B0": 0.05},
  "stages": 4,
  "act_bytes": 2.0 * 4 * 128 * 256,
  "shared_grad_bytes": 4.0 * 385 * 256,
}


def test_tc_commands_shape_each_destination_at_the_files_rate():
  topo = topology_lib.load(str(sn.TOPOLOGY))
  cmds = [" ".join(c) for c in sn.tc_commands(topo, 0, "acco_e0")]
  assert cmds[0] == "tc qdisc add dev acco_e0 root handle 1: htb"
  classes = [c for c in cmds if " class add " in c]
  filters = [c for c in cmds if " filter add " in c]
  assert len(classes) == len(filters) == 3  # one per other node, none toward itself
  assert "classid 1:2 htb rate 1000mbit ceil 1000mbit" in classes[0]  # same region
  assert "classid 1:3 htb rate 50mbit ceil 50mbit" in classes[1]  # across regions
  assert filters[2].endswith("match ip dst 10.77.0.4/32 flowid 1:4")
  assert not any("netem" in c for c in cmds)
  with_delay = [" ".join(c) for c in sn.tc_commands(topo, 2, "acco_e2", netem=True)]
  assert (
    "tc qdisc add dev acco_e2 parent 1:1 handle 10: netem delay 0.05ms limit 10000" in with_delay
  )


def test_latency_that_cannot_be_emulated_is_refused(tmp_path):
  path = tmp_path / "far.json"
  path.write_text(
    '{"speed": [1, 1], "region": ["a", "b"], "latency_ms": [[0, 40], [40, 0]],'
    ' "bandwidth_gbps": [[1, 0.1], [0.1, 1]]}'
  )
  topo = topology_lib.load(str(path))
  with pytest.raises(ValueError, match="40 ms link"):
    sn.tc_commands(topo, 0, "acco_e0", netem=False)
  assert any("netem" in c for c in sn.tc_commands(topo, 0, "acco_e0", netem=True))


def test_runtime_order_replays_the_tick_table():
  paths = paths_lib.random_paths(4, 4, 0.25, True, __import__("numpy").random.default_rng(0))
  schedule = ticks.build(paths, 4, "1f1b")
  order = sp.runtime_order(schedule)
  # every step of every microbatch once, on the stage its chain puts it on
  assert sorted(x for o in order for x in o) == sorted(
    (m, j) for m, p in enumerate(paths) for j in range(len(ticks.chain(p)))
  )
  for s, steps in enumerate(order):
    assert all(ticks.chain(paths[m])[j][1] == s for m, j in steps)
  topo = topology_lib.load(str(sn.TOPOLOGY))
  routes = [simulate.Route(0, tuple(p), tuple(p)) for p in paths]
  costs = sp.costs_of(MEASURED)
  assert simulate.replay(topo, costs, routes, order).makespan > 0


def test_predictions_price_the_slow_link():
  topo = topology_lib.load(str(sn.TOPOLOGY))
  fast = sn.unshaped(topo)
  for name in ("gpipe", "1f1b", "skippipe"):
    slow, quick = (
      sp.predict(topo, MEASURED, sn.SCHEDULES[name]),
      sp.predict(fast, MEASURED, sn.SCHEDULES[name]),
    )
    # two activations cross the 50 Mbit/s link each way per full path: 262 kB -> 42 ms each
    assert slow["replay_s"] > quick["replay_s"] + 0.1, name
    assert slow["sync_s"] > 10 * quick["sync_s"]
  gpipe = sp.predict(topo, MEASURED, sn.SCHEDULES["gpipe"])
  assert gpipe["sim_s"] == pytest.approx(gpipe["replay_s"])  # gpipe's tick order is its policy's
