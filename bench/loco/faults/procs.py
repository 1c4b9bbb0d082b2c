"""The processes of one scenario: started, signalled and stopped by their handles only
(:class:`Launcher`), slowed by a duty cycle (:class:`Slowdown`), stopped for a while
(:func:`stall`), and waited for until a worker reaches a stage (:func:`wait_for_stage`)."""

from __future__ import annotations

import collections
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from bench import common
from bench.loco.faults.watch import Tail

DUTY_PERIOD_S = 0.3


class Launcher:
  """Starts and signals the processes of one scenario (only those, by their handles)."""

  def __init__(self, root: Path, env: dict, prefix: list[str] | None = None):
    self.root, self.env, self.prefix = root, env, prefix or []
    self.procs: dict[str, subprocess.Popen] = {}
    self.logs: dict[str, Path] = {}
    self.started: dict[str, list[float]] = collections.defaultdict(list)

  def start(self, name: str, cmd: list[str], prefix: list[str] | None = None) -> None:
    log = self.root / f"{name}.{len(self.started[name])}.log"
    self.logs[name] = log
    with open(log, "w") as f:
      self.procs[name] = subprocess.Popen(
        [*(self.prefix if prefix is None else prefix), *cmd],
        cwd=common.REPO,
        env=self.env,
        stdout=f,
        stderr=subprocess.STDOUT,
      )
    self.started[name].append(time.time())

  def signal(self, name: str, sig: int) -> None:
    p = self.procs[name]
    if p.poll() is None:
      p.send_signal(sig)

  def alive(self) -> list[str]:
    return [n for n, p in self.procs.items() if p.poll() is None]

  def wait_all(self, cap_s: float) -> bool:
    """True if every process ended within ``cap_s``; the rest are killed."""
    deadline = time.time() + cap_s
    while self.alive() and time.time() < deadline:
      time.sleep(0.2)
    capped = bool(self.alive())
    self.stop()
    return not capped

  def stop(self) -> None:
    for p in self.procs.values():
      if p.poll() is None:
        p.send_signal(signal.SIGCONT)
        p.kill()
      p.wait(timeout=30)

  def exit_codes(self) -> dict[str, int | None]:
    return {n: p.returncode for n, p in self.procs.items()}

  def tail(self, name: str, chars: int = 1500) -> str:
    return f"--- {name}\n" + self.logs[name].read_text()[-chars:]


class Slowdown:
  """Runs a process ``1/factor`` of every ``period`` seconds (SIGCONT / SIGSTOP) until stopped."""

  def __init__(self, proc: subprocess.Popen, factor: float, period: float = DUTY_PERIOD_S):
    self.proc, self.run_s = proc, period / factor
    self.stop_s = period - self.run_s
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  def _loop(self) -> None:
    while not self._done.is_set() and self.proc.poll() is None:
      time.sleep(self.run_s)
      self.proc.send_signal(signal.SIGSTOP)
      time.sleep(self.stop_s)
      if self.proc.poll() is None:
        self.proc.send_signal(signal.SIGCONT)

  def stop(self) -> None:
    self._done.set()
    self._thread.join()
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGCONT)


def stall(launcher: Launcher, name: str, seconds: float) -> float:
  """SIGSTOP ``name`` for ``seconds``, then SIGCONT; returns when it went on."""
  launcher.signal(name, signal.SIGSTOP)
  time.sleep(seconds)
  launcher.signal(name, signal.SIGCONT)
  return time.time()


def slow_down(launcher: Launcher, name: str, factor: float, seconds: float) -> float:
  """Runs ``name`` at ``1/factor`` of its pace for ``seconds``; returns when it ended."""
  slow = Slowdown(launcher.procs[name], factor)
  time.sleep(seconds)
  slow.stop()
  return time.time()


def wait_for_stage(tail: Tail, workdir: Path, stage: int, launcher: Launcher, cap_s: float):
  """Returns once ``workdir``'s worker logged ``stage``; raises with the logs' tails when a
  process failed or ``cap_s`` passed first."""
  deadline = time.time() + cap_s
  while tail.stage(workdir) < stage:
    dead = [n for n, p in launcher.procs.items() if p.poll() not in (None, 0)]
    if time.time() > deadline or dead:
      names = dead or list(launcher.procs)
      raise RuntimeError(
        f"stage {stage} not reached (ended: {dead})\n" + "\n".join(launcher.tail(n) for n in names)
      )
    time.sleep(0.05)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
