"""Errors the user causes and can fix: a config value, a flag, a file, the environment.

``train.py`` prints any :class:`UserError` as one line, ``error: <message>``, and exits with status 2;
every other exception is an internal error and keeps its traceback. Each class also derives from the
built-in exception a library caller would expect (``ValueError``, ``FileNotFoundError``, ...), so
``except ValueError`` keeps working. Messages are one line that names the problem and the fix.
"""


class UserError(Exception):
  """Base class: the user's input is wrong, not the program."""


class UserValueError(UserError, ValueError):
  """A config value, flag, argument or saved state that cannot work as given."""


class UserFileNotFoundError(UserError, FileNotFoundError):
  """A file or dataset the config points to does not exist."""


class UserIsADirectoryError(UserError, IsADirectoryError):
  """A path the config points to is a directory where a file is expected."""


class UserRuntimeError(UserError, RuntimeError):
  """The environment cannot do what the config asks (a missing package, no network, no backend)."""


class UserTimeoutError(UserError, TimeoutError):
  """Something the config names did not answer in time (e.g. the coordinator)."""
