"""Device prefetch: the next batches are read, placed and on the device while the current step runs.

A background thread takes batches from a checkpointable iterator (:class:`BatchIterator`), places
each one with ``put`` (e.g. :func:`acco_jax.parallel.global_batch`, which keeps
``jax.make_array_from_process_local_data`` for multi-process runs) and queues it with the
iterator's position *after* it. The loop therefore checkpoints the position of the batches it has
consumed, not of those read ahead, and a resumed run continues bit for bit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any


class _Raised:
  def __init__(self, error: BaseException):
    self.error = error


class Prefetcher:
  """Iterator of ``(placed_batch, position_after_it)``, ``depth`` batches ahead of the consumer.

  Args:
    stream: an iterator with ``get_state()`` (its position, a JSON-able dict); nothing else may
      advance it once the prefetcher is built (call its ``set_state`` before).
    put: host batch -> device batch (runs on the background thread).
    depth: batches kept ready (2: double buffering).

  The thread stops at :meth:`close` (also a context manager); an exception raised by ``stream`` or
  ``put`` (``StopIteration`` included) is raised again by ``next`` in the consumer's thread, after
  the batches read before it.
  """

  def __init__(self, stream: Iterator, put: Callable[[Any], Any], depth: int = 2):
    if depth < 1:
      raise ValueError(f"prefetch depth must be >= 1, got {depth}")
    self._stream, self._put = stream, put
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._done = False
    self._thread = threading.Thread(target=self._run, name="acco-prefetch", daemon=True)
    self._thread.start()

  def _offer(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.05)
        return True
      except queue.Full:
        continue
    return False

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        placed = self._put(next(self._stream))
        if not self._offer((placed, self._stream.get_state())):
          return
    except BaseException as e:  # handed to the consumer, who raises it
      self._offer(_Raised(e))

  def __iter__(self) -> Prefetcher:
    return self

  def __next__(self) -> tuple[Any, dict]:
    if self._done:
      raise StopIteration
    item = self._queue.get()
    if isinstance(item, _Raised):
      self._done = True
      raise item.error
    return item

  def close(self) -> None:
    """Stops the thread and drops the batches read ahead."""
    self._stop.set()
    self._thread.join()
    while not self._queue.empty():
      self._queue.get_nowait()

  def __enter__(self) -> Prefetcher:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
