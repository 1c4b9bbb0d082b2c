"""A checkpoint written by an earlier version (the main branch at 9b35d2b, before the model and step
interfaces: tests/old_checkpoints.py) still resumes: each family's run continues from the stage it
stopped at to its last, and the resumed run's losses are a fresh run's with today's code (to float
tolerance: the fixture's first stages were computed on another CPU)."""

import shutil

import numpy as np
import pytest

from acco_jax.run import trainer
from tests.bad_input_test import CACHE
from tests.old_checkpoints import RUNS, config_of
from tests.train_test import rows

FIXTURES = __import__("pathlib").Path(__file__).parent / "data" / "checkpoints_9b35d2b"


def _losses(workdir) -> dict[int, float]:
  return {r["stage"]: r["loss"] for r in rows(workdir) if "loss" in r and "stage" in r}


@pytest.mark.slow  # two runs of each family (~20 s each)
@pytest.mark.parametrize("name", list(RUNS))
def test_an_old_checkpoint_resumes(name, tmp_path):
  workdir = tmp_path / "old"
  shutil.copytree(FIXTURES / name, workdir)
  stopped = RUNS[name][2]
  before = _losses(workdir)
  summary = trainer.train_and_evaluate(config_of(name, str(CACHE)), str(workdir))
  restored = [r for r in rows(workdir) if r.get("event") == "restored"]
  assert [r["stage"] for r in restored] == [stopped]
  fresh = tmp_path / "fresh"
  want = trainer.train_and_evaluate(config_of(name, str(CACHE)), str(fresh))
  assert summary["stages"] == want["stages"] > stopped
  resumed = {s: v for s, v in _losses(workdir).items() if s > stopped}
  assert resumed and set(resumed) == {s for s in _losses(fresh) if s > stopped}
  got = [resumed[s] for s in sorted(resumed)]
  np.testing.assert_allclose(got, [_losses(fresh)[s] for s in sorted(resumed)], rtol=1e-3)
  assert before == {s: v for s, v in _losses(workdir).items() if s <= stopped}  # rows kept
