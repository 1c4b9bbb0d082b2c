"""Nodes, regions and the links between them: the network a pipeline's microbatches cross.

A topology is ``M`` nodes. Node ``i`` has a relative compute speed ``speed_M[i]`` (1.0 runs a stage
in its nominal time, 0.5 takes twice as long) and sits in region ``region_M[i]``. Between every
ordered pair of nodes there is a one-way latency (seconds) and a bandwidth (bytes per second), so
sending ``b`` bytes from ``i`` to ``j`` takes

  transfer(i, j, b) = latency_MxM[i, j] + b / bandwidth_MxM[i, j]     (0 when i == j)

Presets (all seeded):

  single-cluster   one region, homogeneous nodes, 10 us and 100 Gbit/s links
  multi-cluster    3 clusters; inside 10 us / 100 Gbit/s, between clusters 20-60 ms and 1-5 Gbit/s
  geo              10 regions placed on a map; between regions 10-250 ms (growing with distance) and
                   0.1-1 Gbit/s (shrinking with distance); inside a region 1 ms / 10 Gbit/s; node
                   speeds 0.7-1.0 (mixed GPU generations)

A user describes their own cluster in a JSON file (:func:`load`)::

  {"speed": [1, 1, 0.8], "region": ["eu", "eu", "us"],
   "latency_ms": [[0, 1, 90], [1, 0, 90], [90, 90, 0]],
   "bandwidth_gbps": [[100, 10, 1], [10, 100, 1], [1, 1, 100]]}
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from acco_jax import errors

PRESETS = ("single-cluster", "multi-cluster", "geo")
GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclasses.dataclass(frozen=True)
class Topology:
  """``M`` nodes: speeds, regions, one-way latency [s] and bandwidth [bytes/s] per ordered pair."""

  name: str
  speed_M: np.ndarray
  region_M: np.ndarray
  latency_MxM: np.ndarray
  bandwidth_MxM: np.ndarray

  @property
  def num_nodes(self) -> int:
    return int(self.speed_M.shape[0])

  def transfer_MxM(self, num_bytes: float) -> np.ndarray:
    """Seconds to send ``num_bytes`` between every ordered pair of nodes (zero on the diagonal)."""
    t_MxM = self.latency_MxM + num_bytes / self.bandwidth_MxM
    np.fill_diagonal(t_MxM, 0.0)
    return t_MxM


def _symmetric(rng: np.random.Generator, lo: float, hi: float, m: int) -> np.ndarray:
  a = rng.uniform(lo, hi, (m, m))
  return np.triu(a, 1) + np.triu(a, 1).T


def preset(name: str, num_nodes: int, seed: int = 0) -> Topology:
  """A named preset with ``num_nodes`` nodes (see the module docstring); deterministic in ``seed``."""
  rng = np.random.default_rng(seed)
  m = int(num_nodes)
  if m < 1:
    raise errors.UserValueError(f"a topology needs at least 1 node, got {num_nodes}")
  if name == "single-cluster":
    region = np.zeros(m, np.int32)
    speed = np.ones(m)
    lat = np.full((m, m), 1e-5)
    bw = np.full((m, m), 100 * GBIT)
  elif name == "multi-cluster":
    region = np.arange(m, dtype=np.int32) % 3
    speed = np.ones(m)
    lat_c = 0.02 + _symmetric(rng, 0.0, 0.04, 3)
    bw_c = GBIT * (1 + _symmetric(rng, 0.0, 4.0, 3))
    same = region[:, None] == region[None, :]
    lat = np.where(same, 1e-5, lat_c[region][:, region])
    bw = np.where(same, 100 * GBIT, bw_c[region][:, region])
  elif name == "geo":
    n_regions = 10
    xy = rng.uniform(0.0, 1.0, (n_regions, 2))
    dist = np.linalg.norm(xy[:, None] - xy[None, :], axis=-1)
    rel = dist / dist.max()
    lat_r = 0.010 + 0.240 * rel  # 10 ms for neighbours .. 250 ms across the map
    bw_r = GBIT * (1.0 - 0.9 * rel)  # 1 Gbit/s for neighbours .. 0.1 Gbit/s across the map
    region = rng.permutation(np.arange(m) % n_regions).astype(np.int32)
    speed = rng.uniform(0.7, 1.0, m)
    same = region[:, None] == region[None, :]
    lat = np.where(same, 1e-3, lat_r[region][:, region])
    bw = np.where(same, 10 * GBIT, bw_r[region][:, region])
  else:
    raise errors.UserValueError(
      f"pipeline.topology={name!r} is neither a preset nor a .json file: choose one of "
      f"{', '.join(PRESETS)} or the path of a JSON topology file"
    )
  return Topology(
    name, speed.astype(np.float64), region, lat.astype(np.float64), bw.astype(np.float64)
  )


def _fail(path: str, why: str):
  raise errors.UserValueError(
    f"topology file {path} {why}: it must be a JSON object with 'speed' and 'region' (one entry per "
    "node) and square 'latency_ms' and 'bandwidth_gbps' matrices"
  )


def load(path: str) -> Topology:
  """Reads a topology JSON file (format in the module docstring); one-line errors on bad input."""
  if not os.path.isfile(path):
    raise errors.UserFileNotFoundError(
      f"topology file {path} does not exist: fix pipeline.topology"
    )
  try:
    with open(path) as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    _fail(path, f"does not parse as JSON ({str(e).splitlines()[0]})")
  if not isinstance(raw, dict):
    _fail(path, "is not a JSON object")
  missing = [k for k in ("speed", "region", "latency_ms", "bandwidth_gbps") if k not in raw]
  if missing:
    _fail(path, f"lacks {', '.join(missing)}")
  try:
    speed = np.asarray(raw["speed"], np.float64)
    lat = np.asarray(raw["latency_ms"], np.float64) / 1e3
    bw = np.asarray(raw["bandwidth_gbps"], np.float64) * GBIT
  except (TypeError, ValueError):
    _fail(path, "has a non-numeric speed, latency or bandwidth")
  names = [str(r) for r in raw["region"]]
  m = speed.shape[0]
  if speed.ndim != 1 or m < 1 or len(names) != m:
    _fail(path, f"has {len(names)} regions for {speed.shape} speeds")
  if lat.shape != (m, m) or bw.shape != (m, m):
    _fail(path, f"has latency {lat.shape} and bandwidth {bw.shape} for {m} nodes")
  off = ~np.eye(m, dtype=bool)
  if (speed <= 0).any() or (lat < 0).any() or (bw[off] <= 0).any():
    _fail(path, "has a speed or an off-diagonal bandwidth <= 0, or a negative latency")
  bw = np.where(off, bw, np.inf)
  region = np.unique(names, return_inverse=True)[1].astype(np.int32)
  return Topology(os.path.basename(path), speed, region, lat, bw)


def get(spec: str, num_stages: int, seed: int = 0, num_nodes: int = 0) -> Topology:
  """A preset by name, or a JSON file ending in ``.json``.

  Args:
    spec: a preset name or a JSON file's path.
    num_stages: S; every stage needs a node.
    seed: seeds a preset.
    num_nodes: the nodes the run has (a pipeline: one per device): a preset is drawn with that
      many, a file must have that many. 0: a preset has ``default_nodes(num_stages)``, a file any
      number from S up.
  """
  if spec.endswith(".json"):
    topo = load(spec)
    if num_nodes and topo.num_nodes != num_nodes:
      raise errors.UserValueError(
        f"topology file {spec} has {topo.num_nodes} nodes, this pipeline has {num_nodes} devices "
        f"(one node each): write a topology of {num_nodes} nodes or run on {topo.num_nodes} devices"
      )
    if topo.num_nodes < num_stages:
      raise errors.UserValueError(
        f"topology file {spec} has {topo.num_nodes} nodes, fewer than pipeline.stages="
        f"{num_stages}: every stage needs a node; add nodes or lower pipeline.stages"
      )
    return topo
  return preset(spec, num_nodes or default_nodes(num_stages), seed)


def default_nodes(num_stages: int) -> int:
  """Nodes of a preset for ``num_stages`` stages: two per stage and two more for stage 0."""
  return 2 * num_stages + 2
