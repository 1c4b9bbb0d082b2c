"""Every ``python bench/...`` command in the README, docs/ and bench/README.md names a script that
exists and answers ``--help`` (one subprocess runs each script's argument parser in turn), and
bench/README.md lists every benchmark script."""

import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"python3? (?:-\S+ )*(bench/[\w/]+\.py)")
LIBRARIES = {
  "bench/common.py",
  "bench/dp/acco_quantized_cost.py",
  "bench/dp/convergence_settings.py",
  "bench/dp/perfmodel_figures.py",
  "bench/dp/perfmodel_loco.py",
  "bench/gpu/overlap_report.py",
  "bench/gpu/throughput_rows.py",
  "bench/gpu/torch_gpt.py",
  "bench/loco/programs.py",
  "bench/net/skippipe_prediction.py",
  "bench/pipeline/skippipe_sim.py",
}  # imported, not run


def documented() -> dict[str, list[str]]:
  """Script -> the documents whose commands run it."""
  out: dict[str, list[str]] = {}
  for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench/README.md"]:
    for script in COMMAND.findall(doc.read_text()):
      out.setdefault(script, []).append(doc.name)
  return out


def test_documented_commands_name_scripts_that_answer_help():
  scripts = documented()
  assert len(scripts) > 20, scripts
  missing = {s: d for s, d in scripts.items() if not (REPO / s).is_file()}
  assert not missing, f"documented commands name scripts that do not exist: {missing}"
  runner = (
    "import runpy, sys\n"
    "bad = []\n"
    "for path in sys.argv[1:]:\n"
    "  sys.argv = [path, '--help']\n"
    "  try:\n"
    "    runpy.run_path(path, run_name='__main__')\n"
    "    bad.append(path + ': no SystemExit from --help')\n"
    "  except SystemExit as e:\n"
    "    if e.code not in (0, None):\n"
    "      bad.append(f'{path}: --help exited {e.code}')\n"
    "print('BAD', bad)\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", runner, *sorted(scripts)], cwd=REPO, capture_output=True, text=True,
    timeout=300,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "BAD []" in proc.stdout, proc.stdout[-3000:]


def test_bench_readme_lists_every_benchmark():
  listed = set(COMMAND.findall((REPO / "bench/README.md").read_text()))
  every = {
    str(p.relative_to(REPO)) for p in (REPO / "bench").rglob("*.py")
    if p.name != "__init__.py" and "results" not in p.parts
  } - LIBRARIES  # fmt: skip
  assert every - listed == set(), f"bench/README.md does not list {sorted(every - listed)}"
