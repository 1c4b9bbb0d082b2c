"""The store the workers meet through: a local directory (:class:`DirStore`), or S3 over HTTP
from a moto server (:class:`S3Store`), optionally behind shaped links. Each gives the run's URL,
the command prefix of a worker, the environment, and a :class:`RoundsWatcher` of its rounds."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path

from bench.loco.faults.procs import free_port
from bench.loco.faults.watch import RoundsWatcher


class DirStore:
  """A directory; with ``own_hosts`` every worker runs under its own host name (a UTS namespace:
  ``unshare --uts``, root), so that the workers see each other's leases as another host's and
  cannot tell a dead process from a live one by its pid."""

  def __init__(self, root: Path, env: dict, own_hosts: bool = False):
    self.root, self.env, self.own_hosts = root, env, own_hosts

  def url(self, run: str) -> str:
    return str(self.root / run)

  def prefix(self, worker: int) -> list[str]:
    if not self.own_hosts:
      return []
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"worker{worker}"]

  def watch(self, url: str) -> RoundsWatcher:
    from fsspec.implementations.local import LocalFileSystem

    return RoundsWatcher(LocalFileSystem(), url, 0.5)

  def close(self) -> None:
    pass


class S3Store:
  """A moto S3 server on a port, a bucket; optionally namespaces with shaped links."""

  BUCKET = "acco-faults"

  def __init__(self, args, env: dict, tmp: Path):
    from bench.net import netns

    self.netns, self.shaped = netns, None
    self.port, self.proc = free_port(), None
    host, server_prefix = "127.0.0.1", []
    if args.shape_mbit:
      host, server_prefix = self.shape_links(args.workers, args.shape_mbit)
    self.endpoint = f"http://{host}:{self.port}"
    self.env = {
      **env,
      "AWS_ACCESS_KEY_ID": "testing",
      "AWS_SECRET_ACCESS_KEY": "testing",
      "AWS_DEFAULT_REGION": "us-east-1",
      "AWS_ENDPOINT_URL": self.endpoint,
      "FSSPEC_S3_ENDPOINT_URL": self.endpoint,
    }
    self.log = open(tmp / "moto.log", "w")
    self.proc = subprocess.Popen(
      [*server_prefix, args.moto, "-H", "0.0.0.0", "-p", str(self.port)],
      stdout=self.log,
      stderr=subprocess.STDOUT,
    )
    self.local_endpoint = self.endpoint
    self.create_bucket()

  def shape_links(self, workers: int, mbit: float) -> tuple[str, list[str]]:
    """Namespaces on a bridge, host 0 the server's and 1..M the workers', every link shaped to
    ``mbit``; returns the server's address and its command prefix."""
    netns = self.netns
    why = netns.netns_ok()
    if why:
      raise SystemExit(f"--shape-mbit: {why}")
    netns.cleanup()
    self.shaped = netns.setup(workers + 1)
    netns.shape(self.shaped, mbit)
    self.bench_link(netns)
    return f"{netns.SUBNET}.1", ["ip", "netns", "exec", f"{netns.PREFIX}h0"]

  def create_bucket(self) -> None:
    """S3's CreateBucket (a PUT of /<bucket>; moto checks no signature), retried while the server
    starts; a server that does not start within 60 s is stopped with its namespaces."""
    deadline = time.time() + 60
    while True:
      try:
        urllib.request.urlopen(
          urllib.request.Request(f"{self.endpoint}/{self.BUCKET}", method="PUT"), timeout=5
        ).close()
        return
      except OSError as e:
        if time.time() > deadline or self.proc.poll() is not None:
          self.close()
          raise RuntimeError(f"moto server at {self.endpoint} did not start: {e}") from e
        time.sleep(0.5)

  @staticmethod
  def bench_link(netns) -> None:
    """An unshaped link from this (the root) namespace to the bridge, for the bench's own reads
    of the store; named like the others so that :func:`bench.net.netns.cleanup` removes it."""
    here, there = f"{netns.PREFIX}rt", f"{netns.PREFIX}rtp"
    netns.sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
    netns.sh("ip", "link", "set", there, "netns", f"{netns.PREFIX}sw")
    netns.sh("ip", "-n", f"{netns.PREFIX}sw", "link", "set", there, "master", f"{netns.PREFIX}br")
    netns.sh("ip", "-n", f"{netns.PREFIX}sw", "link", "set", there, "up")
    netns.sh("ip", "addr", "add", f"{netns.SUBNET}.250/24", "dev", here)
    netns.sh("ip", "link", "set", here, "up")

  def fs(self):
    import s3fs

    return s3fs.S3FileSystem(
      key="testing",
      secret="testing",
      client_kwargs={"endpoint_url": self.local_endpoint, "region_name": "us-east-1"},
      skip_instance_cache=True,
    )

  def url(self, run: str) -> str:
    return f"s3://{self.BUCKET}/{run}"

  def prefix(self, worker: int) -> list[str]:
    if not self.shaped:
      return []
    return ["ip", "netns", "exec", f"{self.netns.PREFIX}h{worker + 1}"]

  def watch(self, url: str) -> RoundsWatcher:
    return RoundsWatcher(self.fs(), url[len("s3://") :], 1.0)

  def close(self) -> None:
    if self.proc and self.proc.poll() is None:
      self.proc.terminate()
      self.proc.wait(timeout=30)
    self.log.close()
    if self.shaped:
      self.netns.cleanup()
