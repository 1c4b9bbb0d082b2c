"""MetricWriter's TensorBoard events are written without importing torch (tensorboardX imports it
when it is installed: 1.8 s of every launch), and torch stays importable afterwards.

A fake ``torch`` package on the subprocess's path records whether it was imported; the control
shows that a plain ``import tensorboardX`` imports it.
"""

import os
import pathlib
import struct
import subprocess
import sys

import pytest

pytest.importorskip("tensorboardX")

REPO = pathlib.Path(__file__).resolve().parent.parent
FAKE_TORCH = """import os, pathlib
pathlib.Path(os.environ["TORCH_MARK"]).write_text("imported")
class Tensor:  # what tensorboardX reads of torch at import
  pass
"""


def run_python(code: str, tmp_path: pathlib.Path) -> bool:
  """Runs ``code`` with the fake torch first on the path; whether anything imported it."""
  site = tmp_path / "site"
  (site / "torch").mkdir(parents=True, exist_ok=True)
  (site / "torch" / "__init__.py").write_text(FAKE_TORCH)
  mark = tmp_path / "torch_imported"
  mark.unlink(missing_ok=True)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), TORCH_MARK=str(mark))
  proc = subprocess.run(
    [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return mark.exists()


def scalars(tb_dir: pathlib.Path) -> list[tuple[int, str, float]]:
  """(step, tag, value) of every scalar in the event files, read record by record (TFRecord
  framing: length, its CRC, the serialized Event, its CRC) with tensorboardX's own protos."""
  from tensorboardX.proto.event_pb2 import Event

  out = []
  for path in sorted(tb_dir.glob("events.out.tfevents.*")):
    data, pos = path.read_bytes(), 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos : pos + 8])
      event = Event.FromString(data[pos + 12 : pos + 12 + length])
      pos += 12 + length + 4
      out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
  return out


def test_a_plain_tensorboardx_import_imports_torch(tmp_path):
  assert run_python("import tensorboardX", tmp_path)


def test_metric_writer_writes_events_without_importing_torch(tmp_path):
  workdir = tmp_path / "run"
  code = f"""
import os, sys
from acco_jax.run import metrics
w = metrics.MetricWriter({str(workdir)!r})
w.write(3, {{"loss": 2.5, "lr": 1e-3}})
w.write(4, {{"loss": 2.25}})
w.close()
assert "torch" not in sys.modules and not os.path.exists(os.environ["TORCH_MARK"])
"""
  assert not run_python(code, tmp_path)
  assert sorted(scalars(workdir / "tb")) == [
    (3, "loss", 2.5),
    (3, "lr", pytest.approx(1e-3)),
    (4, "loss", 2.25),
  ]


def test_torch_imported_before_or_after_the_writer_is_the_real_module(tmp_path):
  before = f"""
import sys, torch
from acco_jax.run import metrics
metrics.MetricWriter({str(tmp_path / "before")!r}).close()
assert sys.modules["torch"] is torch
"""
  assert run_python(before, tmp_path)
  after = f"""
import sys
from acco_jax.run import metrics
metrics.MetricWriter({str(tmp_path / "after")!r}).close()
assert "torch" not in sys.modules
import torch
assert sys.modules["torch"] is torch
"""
  assert run_python(after, tmp_path)
