"""What the bench reads while a run goes: the workers' ``metrics.jsonl`` rows (:class:`Tail`, each
row with the time it was seen, anchored to the clock by :func:`timeline`) and the rounds a store
decided (:class:`RoundsWatcher`)."""

from __future__ import annotations

import collections
import json
import threading
import time
from pathlib import Path


class Poller:
  """Calls ``poll`` every ``every`` seconds in a thread from :meth:`start`, and once more at
  :meth:`close`."""

  every = 0.1

  def poll(self) -> None:
    raise NotImplementedError

  def start(self) -> None:
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  def _loop(self) -> None:
    while not self._stop.wait(self.every):
      self.poll()

  def close(self) -> None:
    self._stop.set()
    self._thread.join()
    self.poll()


class Tail(Poller):
  """Reads new lines of some ``metrics.jsonl`` files every 0.1 s; keeps (time seen, row)."""

  def __init__(self):
    self.lines: dict[Path, list[tuple[float, dict]]] = collections.defaultdict(list)
    self._pos: dict[Path, int] = collections.defaultdict(int)
    self._lock = threading.Lock()
    self.start()

  def watch(self, workdir: Path) -> None:
    with self._lock:
      self.lines.setdefault(workdir / "metrics.jsonl", [])

  def poll(self) -> None:
    with self._lock:
      for path in list(self.lines):
        if not path.exists():
          continue
        with open(path) as f:
          f.seek(self._pos[path])
          text = f.read()
        done = text.rfind("\n") + 1  # whole lines only
        self._pos[path] += done
        now = time.time()
        for line in text[:done].splitlines():
          if line.strip():
            self.lines[path].append((now, json.loads(line)))

  def stage(self, workdir: Path) -> int:
    with self._lock:
      rows = self.lines[workdir / "metrics.jsonl"]
      return max((r["stage"] for _, r in rows if "loss" in r), default=0)


def timeline(seen: list[tuple[float, dict]]) -> list[dict]:
  """The training rows with ``t``: ``wall_s`` plus its launch's offset to the clock.

  A launch starts at a ``config`` event or where ``wall_s`` goes back; its offset is the smallest
  (time seen - wall_s) over its rows (a row is seen one stage late at best, much later when its
  process was stopped)."""
  launches, last_wall = [], None
  for at, row in seen:
    new = row.get("event") == "config" or (
      "wall_s" in row and last_wall is not None and row["wall_s"] < last_wall
    )
    if new or not launches:
      launches.append([])
    if "loss" in row and "wall_s" in row:
      launches[-1].append((at, row))
      last_wall = row["wall_s"]
    if row.get("event") == "config":
      last_wall = None
  out = []
  for i, rows in enumerate(launches):
    if rows:
      offset = min(at - r["wall_s"] for at, r in rows)
      out += [{**r, "t": r["wall_s"] + offset, "launch": i} for _, r in rows]
  return out


def summaries(seen: list[tuple[float, dict]]) -> list[dict]:
  """The rows with an evaluation loss."""
  return [r for _, r in seen if "eval_loss" in r]


class RoundsWatcher(Poller):
  """Reads every new ``rounds/<r>/set.json`` of a store while the run goes (the workers collect
  old rounds), every ``every`` seconds and once more at the end."""

  def __init__(self, fs, path: str, every: float):
    self.fs, self.path, self.every = fs, path.rstrip("/"), every
    self.found: dict[int, dict] = {}
    self.start()

  def poll(self) -> None:
    self.fs.invalidate_cache()  # s3fs caches listings
    try:
      names = self.fs.ls(f"{self.path}/rounds", detail=False)
    except (FileNotFoundError, OSError):
      return
    for name in names:
      r = name.rstrip("/").split("/")[-1]
      if not r.isdigit() or int(r) in self.found:
        continue
      try:
        self.found[int(r)] = json.loads(self.fs.cat_file(f"{self.path}/rounds/{r}/set.json"))
      except (FileNotFoundError, OSError, ValueError):
        continue  # not decided yet, or collected meanwhile

  def close(self) -> list[dict]:
    """The rounds found, in order."""
    super().close()
    return [{"round": r, **self.found[r]} for r in sorted(self.found)]
