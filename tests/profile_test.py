"""Reading a profile: ``acco_jax.analysis.trace`` and ``bench/gpu/profile_table.py`` on a trace written
here, whose every figure is worked out by hand below; the trainer's ``train.profile_stages`` trace
is read in ``tests/trainer_loop_test.py`` (the ACCO run traces stages 4 to 5)."""

import gzip
import json

import pytest

from acco_jax.analysis import trace
from bench.gpu import profile_table  # noqa: E402

GPU, HOST = 1, 701


def x(pid, name, ts, dur, **args):
  return {"ph": "X", "pid": pid, "tid": 1, "ts": ts, "dur": dur, "name": name, "args": args}


def synthetic_events():
  """Two stages dispatched at t = 0 and 100 us (host calls of 90 and 80 us). Stage 1's window
  [0, 100): a GEMM 10-40, a fusion 30-60 (overlapping it by 10), a D2H copy 70-72; stage 2's
  window [100, 190): cuDNN attention 100-150, an NCCL all-reduce 160-190 (the last kernel ends at
  190). Kernel time 30 + 30 + 2 + 50 + 30 = 142 us over the span 10-190 (180 us), of which 50 + 2
  + 50 + 30 = 132 us are covered; the idle gaps: 60-70 (10), 72-100 (28), 150-160 (10)."""
  meta = [
    {"ph": "M", "pid": GPU, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "pid": HOST, "name": "process_name", "args": {"name": "/host:CPU"}},
  ]
  return meta + [
    x(HOST, "stage", 0, 90, step_num="1"),
    x(HOST, "stage", 100, 80, step_num="2"),
    x(HOST, "PjitFunction(stage)", 1, 88),
    x(GPU, "nvjet_sm90_tst_128x128_NNT", 10, 30),
    x(GPU, "input_add_reduce_fusion_9", 30, 30),
    x(GPU, "MemcpyD2H", 70, 2),
    x(GPU, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 100, 50),
    x(GPU, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 160, 30),
  ]


def test_trace_figures_against_the_hand_count():
  events = synthetic_events()
  kernels = trace.gpu_kernels(events)
  kinds, names = trace.kernel_table(kernels)
  assert kinds == {
    "GEMM": 30,
    "attention": 50,
    "XLA fusion": 30,
    "collective": 30,
    "memcpy/memset": 2,
  }
  assert names[0] == ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 50.0, 1)
  frac, gaps = trace.busy(kernels, 10, 190)
  assert frac == pytest.approx(132 / 180)
  assert gaps == [(72, 28), (60, 10), (150, 10)]
  rows = trace.stage_rows(events)
  assert [r["stage"] for r in rows] == [1, 2]
  one, two = rows
  assert (one["dispatch_ms"], one["window_ms"]) == (pytest.approx(0.09), pytest.approx(0.1))
  assert one["gpu_busy"] == pytest.approx(52 / 100) and one["d2h_copies"] == 1
  assert one["largest_gap_ms"] == pytest.approx(0.028)
  assert two["window_ms"] == pytest.approx(0.09) and two["gpu_busy"] == pytest.approx(80 / 90)
  assert two["d2h_copies"] == 0 and two["largest_gap_ms"] == pytest.approx(0.01)


def test_a_trace_without_annotations_takes_the_jitted_calls():
  """A bare step's trace: the most frequent jitted function's calls are the stages; a call nested
  in another (the same dispatch seen twice) is one."""
  events = [e for e in synthetic_events() if e.get("name") != "stage"]
  events.append(x(HOST, "PjitFunction(stage)", 1.5, 80))  # nested in the first
  events.append(x(HOST, "PjitFunction(stage)", 101, 70))
  events.append(x(HOST, "PjitFunction(copy)", 95, 1))
  assert [(s.step, s.start) for s in trace.stages(events)] == [(1, 1.0), (2, 101.0)]


def test_the_table_prints_what_the_trace_holds(tmp_path, capsys):
  path = tmp_path / "t.trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": synthetic_events()}, f)
  r = profile_table.report(str(path))
  assert r["gpu_busy"] == pytest.approx(132 / 180) and r["kernel_ms"] == pytest.approx(0.142)
  text = profile_table.render(r)
  assert "busy 73.3%" in text and "| attention | 0.1 | 35.2% |" in text
  assert "| 1 | 0.1 | 0.1 | 52.0% | 0.03 | 1 |" in text
  cpu = [e for e in synthetic_events() if e.get("pid") != GPU]
  assert "no GPU kernels in this trace" in profile_table.render(
    {**r, "gpu_kernels": 0, "stages": trace.stage_rows(cpu)}
  )
