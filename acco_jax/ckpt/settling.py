"""Event loops that end their pending tasks when closed, for orbax's restores (:mod:`checkpoint`).

Orbax runs each restore in a fresh event loop that it closes as soon as the restore returns or
raises; :func:`settled_loops` makes the loops the calling thread creates meanwhile cancel and await
what is still pending on close, as ``asyncio.run`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class SettlingLoop(asyncio.SelectorEventLoop):
  """An event loop that, when closed, first cancels the tasks still pending and waits for them.

  Orbax runs each restore in a fresh event loop that it closes as soon as the restore returns or
  raises. When one array read fails (a damaged file), ``asyncio.gather`` raises at once and the
  other reads are left pending in the closed loop: the garbage collector later closes their
  coroutines, and orbax's reader turns that ``GeneratorExit`` into an exception that Python can
  only report as unraisable ("Exception ignored in: <coroutine object
  _read_array_index_and_device_put>"). This loop ends them the way ``asyncio.run`` does, and marks
  the failures of its finished tasks as retrieved (the restore has already raised the first one;
  the others would be logged as "Task exception was never retrieved").
  """

  def __init__(self):
    super().__init__()
    self._tasks: list[asyncio.Task] = []
    self.set_task_factory(self._track)

  def _track(self, loop, coro, **kwargs) -> asyncio.Task:
    task = asyncio.Task(coro, loop=loop, **kwargs)
    self._tasks.append(task)
    return task

  def call_soon_threadsafe(self, callback, *args, context=None):
    """As the base loop's, but a callback that arrives after the close is dropped: a read that
    tensorstore completes (in its own thread) after the restore gave up on it would otherwise raise
    "Event loop is closed" in that thread, where Python can only report it as unraisable."""
    try:
      return super().call_soon_threadsafe(callback, *args, context=context)
    except RuntimeError:
      if self.is_closed():
        return None
      raise

  def close(self) -> None:
    if not self.is_closed() and not self.is_running():
      pending = [t for t in self._tasks if not t.done()]
      for t in pending:
        t.cancel()
      if pending:
        self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
      for t in self._tasks:
        if not t.cancelled():
          t.exception()
      self._tasks.clear()
      # async generators the reads left open: closed here, not by a finalizer that would schedule
      # their close on this loop once it is closed ("Event loop is closed", unraisable)
      self.run_until_complete(self.shutdown_asyncgens())
    super().close()


class SettlingPolicy(asyncio.DefaultEventLoopPolicy):
  """The default policy, except that the thread that installed it gets :class:`SettlingLoop`s."""

  def __init__(self, previous: asyncio.AbstractEventLoopPolicy):
    super().__init__()
    self._previous, self._thread = previous, threading.get_ident()

  def get_event_loop(self):
    return self._previous.get_event_loop()

  def set_event_loop(self, loop) -> None:
    self._previous.set_event_loop(loop)

  def new_event_loop(self):
    if threading.get_ident() == self._thread:
      return SettlingLoop()
    return self._previous.new_event_loop()


@contextlib.contextmanager
def settled_loops():
  """Within: event loops this thread creates (orbax's, for a restore) settle their tasks on close."""
  previous = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(SettlingPolicy(previous))
  try:
    yield
  finally:
    asyncio.set_event_loop_policy(previous)
