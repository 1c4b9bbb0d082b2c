r"""Trains a GPT with ACCO or a baseline.

  python train.py --config configs/gpt2_acco.py --workdir runs/acco
  python train.py --config configs/gpt2_acco.py:gpt2 --workdir runs/acco-124m --config.opt.lr=6e-4

Rerunning the same command resumes from the newest checkpoint in ``--workdir``.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file(
  "config", None, "Config file, e.g. configs/gpt2_acco.py[:preset].", lock_config=True
)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the final sample.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = flags.FLAGS.config
  if not flags.FLAGS["verbosity"].present:  # keep the terminal to progress lines and results
    logging.set_verbosity(logging.WARNING)
  from acco_jax import parallel  # imports jax, but the backend starts only at the first operation

  parallel.configure_platform(cpu_devices=config.mesh.cpu_devices)
  parallel.initialize_distributed(
    config.dist.initialize, coordinator_address=config.dist.coordinator_address,
    num_processes=config.dist.num_processes, process_id=config.dist.process_id,
    timeout_s=config.dist.timeout_s,
  )  # fmt: skip
  from acco_jax import trainer

  trainer.train_and_evaluate(config, flags.FLAGS.workdir)


if __name__ == "__main__":
  sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
  app.run(main)
