r"""Trains a GPT with ACCO or a baseline.

  python train.py --config configs/gpt2_acco.py --workdir runs/acco
  python train.py --config configs/gpt2_acco.py:gpt2 --workdir runs/acco-124m --config.opt.lr=6e-4

Rerunning the same command resumes from the newest checkpoint in ``--workdir``.
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


def _flags_error(message: str):
  sys.exit(
    f"FATAL Flags parsing error: {message}\nPass --helpshort or --helpfull for help on flags."
  )


def _config_file_error(error: OSError):
  """A config file that failed to load: ml_collections reports it on first use, as a traceback."""
  cause = error.__cause__ or error  # its last line names the file and the reason
  _flags_error(f"flag --config: {str(cause).strip().splitlines()[-1].strip()}")


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with one-line errors where ml_collections gives a traceback: a config file
  whose get_config raised, that cannot be read, or an override of a field the config lacks."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    _flags_error(f"{lines[0]} {lines[-1]}" if len(lines) > 1 else str(e))
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
    _flags_error(
      f"flag {flag}: the config has no field {key!r}{'; ' + hint if hint else ''} (fields and "
      "defaults: configs/common.py)"
    )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = flags.FLAGS.config
  try:
    config.mesh  # noqa: B018 (a config file that failed to load raises on first use)
  except OSError as e:
    _config_file_error(e)
  if not flags.FLAGS["verbosity"].present:  # keep the terminal to progress lines and results
    logging.set_verbosity(logging.WARNING)
  from acco_jax import parallel  # imports jax, but the backend starts only at the first operation

  parallel.configure_platform(cpu_devices=config.mesh.cpu_devices)
  parallel.initialize_distributed(
    config.dist.initialize, coordinator_address=config.dist.coordinator_address,
    num_processes=config.dist.num_processes, process_id=config.dist.process_id,
    timeout_s=config.dist.timeout_s,
  )  # fmt: skip
  try:  # start the backend: JAX fails on JAX_PLATFORMS=cuda without its plugin with no message
    parallel.jax.devices()
  except AssertionError:
    raise RuntimeError(
      f"JAX has no usable backend for JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r}: install "
      "its plugin (e.g. pip install 'jax[cuda12]') or unset JAX_PLATFORMS to use the devices here"
    ) from None
  import jax

  from acco_jax import monitor, trainer

  try:
    trainer.train_and_evaluate(config, flags.FLAGS.workdir)
  except Exception as e:
    if jax.process_count() == 1:
      raise
    # a normal exit would wait in jax.distributed's shutdown for peers that may be dead: print
    # the error (a failed collective names the lost peer) and leave now; 75 = retry (resume)
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(monitor.HANG_EXIT_CODE if monitor.is_collective_failure(e) else 1)


if __name__ == "__main__":
  sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
  app.run(main, flags_parser=_parse_flags)
