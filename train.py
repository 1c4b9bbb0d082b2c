r"""Trains a GPT with ACCO or a baseline.

  python train.py --config configs/gpt2_acco.py --workdir runs/acco
  python train.py --config configs/gpt2_acco.py:gpt2 --workdir runs/acco-124m --config.opt.lr=6e-4

Rerunning the same command resumes from the newest checkpoint in ``--workdir``. A mistake in the
config, the flags, the files or the environment ends the run before it starts, with one line
``error: <message>`` on stderr and exit status 2, and nothing written to ``--workdir``.
"""

import os
import sys
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file(
  "config", None, "Config file, e.g. configs/gpt2_acco.py[:preset].", lock_config=True
)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the final sample.")
flags.mark_flags_as_required(["config", "workdir"])

USER_ERROR_EXIT = 2
HELP = {"--help": True, "-h": True, "-?": True, "--helpshort": True, "--helpfull": False}


def _user_error(message: str, *, hard: bool = False):
  """One line on stderr, exit status 2. ``hard``: skip the interpreter's shutdown (which would
  wait in jax.distributed's for peers that may be gone)."""
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  if hard:
    os._exit(USER_ERROR_EXIT)
  sys.exit(USER_ERROR_EXIT)


def _config_file_error(error: OSError):
  """A config file that failed to load: ml_collections reports it on first use, as a traceback."""
  cause = error.__cause__ or error  # its last line names the file and the reason
  _user_error(f"flag --config: {str(cause).strip().splitlines()[-1].strip()}")


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with one-line errors where absl and ml_collections print a traceback or
  usage: a config file whose get_config raised, that cannot be read, an override of a field the
  config lacks, a missing flag. ``--help`` prints the usage and exits 0."""
  asked = [a for a in argv[1:] if a in HELP]
  if asked:
    app.usage(shorthelp=HELP[asked[0]], writeto_stdout=True)
    sys.exit(0)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    _user_error(f"{lines[0]} {lines[-1]}" if len(lines) > 1 else str(e))
  except OSError as e:
    _config_file_error(e)
  except (AttributeError, KeyError) as e:  # --config.<field> that the config does not have
    error = e.args[0] if e.args and isinstance(e.args[0], KeyError) else e
    text = " ".join(str(error.args[0] if error.args else error).split())
    key, _, hint = text.partition(" ")
    key = key.strip("'\"")
    names = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
    flag = next((n for n in names if key in n.split(".")), None)
    if flag is None:  # not an override: an error of the config file itself
      raise
    _user_error(
      f"flag {flag}: the config has no field {key!r}{'; ' + hint if hint else ''} (fields and "
      "defaults: configs/common.py)"
    )


def main(argv):
  if len(argv) > 1:
    _user_error(
      f"unexpected arguments: {' '.join(argv[1:])}; pass options as --config.<group>.<field>=value"
    )
  config = flags.FLAGS.config
  try:
    config.mesh  # noqa: B018 (a config file that failed to load raises on first use)
  except OSError as e:
    _config_file_error(e)
  if not flags.FLAGS["verbosity"].present:  # keep the terminal to progress lines and results
    logging.set_verbosity(logging.WARNING)
  from acco_jax import errors, parallel
  from acco_jax.run import compile_cache, health, monitor  # backend not started yet

  try:
    parallel.check_xla_flags(remember_in=compile_cache.base_dir(config.compile.cache_dir))
    parallel.configure_platform(cpu_devices=config.mesh.cpu_devices)
    try:  # health.exclude=auto: the launch's processes less those health.json names
      launch, dist = health.exclusion(
        config.health.exclude,
        flags.FLAGS.workdir,
        coordinator_address=config.dist.coordinator_address,
        num_processes=config.dist.num_processes,
        process_id=config.dist.process_id,
      )
    except health.Excluded as e:
      print(e, flush=True)
      sys.exit(0)
    hang = config.health.hang_timeout_s  # jax.distributed's own abort must not come first
    parallel.initialize_distributed(
      config.dist.initialize,
      **dist,
      timeout_s=config.dist.timeout_s,
      heartbeat_timeout_s=max(100, int(hang) + 60) if hang > 0 else 0,
    )
    try:  # start the backend: JAX fails on JAX_PLATFORMS=cuda without its plugin with no message
      parallel.jax.devices()
    except AssertionError:
      raise errors.UserRuntimeError(
        f"JAX has no usable backend for JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r}: install "
        "its plugin (e.g. pip install 'jax[cuda12]') or unset JAX_PLATFORMS to use the devices here"
      ) from None
    compile_cache.configure(config.compile.cache_dir)  # before the first compilation
  except errors.UserError as e:
    _user_error(str(e))
  import jax

  from acco_jax.run import registry, trainer

  try:
    family = registry.lookup(config.method)
    if family.train_and_evaluate is not None:  # trains itself (hdee: a trainer run per expert)
      family.train_and_evaluate(config, flags.FLAGS.workdir)
    else:
      trainer.train_and_evaluate(config, flags.FLAGS.workdir, launch=launch)
  except errors.UserError as e:
    _user_error(str(e), hard=jax.process_count() > 1)
  except health.RestartWithout as e:  # checkpointed; every process leaves together
    print(e, file=sys.stderr, flush=True)
    sys.exit(monitor.HANG_EXIT_CODE)
  except Exception as e:
    if jax.process_count() == 1:
      raise
    # a normal exit would wait in jax.distributed's shutdown for peers that may be dead: print
    # the error (a failed collective names the lost peer) and leave now; 75 = retry (resume)
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(monitor.HANG_EXIT_CODE if monitor.is_collective_failure(e) else 1)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  app.run(main, flags_parser=_parse_flags)
