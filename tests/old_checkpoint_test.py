"""A checkpoint written by an earlier version (the main branch at 9b35d2b, before the model and step
interfaces: tests/old_checkpoints.py) still resumes: each family's run continues from the stage it
stopped at to its last, and the resumed stages' losses are the ones that version logged running the
same config without a stop (to 1e-4: computed on another CPU, by other code)."""

import json
import pathlib
import shutil

import numpy as np
import pytest

from acco_jax.run import trainer
from tests.bad_input_test import CACHE
from tests.old_checkpoints import RUNS, config_of
from tests.train_test import rows

FIXTURES = pathlib.Path(__file__).parent / "data" / "checkpoints_9b35d2b"


def _losses(workdir) -> dict[int, float]:
  return {r["stage"]: r["loss"] for r in rows(workdir) if "loss" in r and "stage" in r}


@pytest.mark.slow  # one resumed run of each family (~10 s each)
@pytest.mark.parametrize("name", list(RUNS))
def test_an_old_checkpoint_resumes(name, tmp_path):
  workdir = tmp_path / "old"
  shutil.copytree(FIXTURES / name, workdir)
  stopped = RUNS[name][2]
  before = _losses(workdir)
  want = {int(s): v for s, v in json.loads((workdir / "reference.json").read_text()).items()}
  summary = trainer.train_and_evaluate(config_of(name, str(CACHE)), str(workdir))
  restored = [r for r in rows(workdir) if r.get("event") == "restored"]
  assert [r["stage"] for r in restored] == [stopped]
  assert summary["stages"] == max(want) > stopped
  resumed = {s: v for s, v in _losses(workdir).items() if s > stopped}
  assert sorted(resumed) == [s for s in sorted(want) if s > stopped]
  np.testing.assert_allclose(
    [resumed[s] for s in sorted(resumed)], [want[s] for s in sorted(resumed)], rtol=1e-3
  )
  assert before == {s: v for s, v in _losses(workdir).items() if s <= stopped}  # rows kept
