"""Every ``python -m bench...`` command in the README, docs/ (its subfolders too), bench/README.md
and the benchmarks' docstrings names a module that exists and answers ``--help`` (one subprocess
runs each module's argument parser in turn); none of them still runs a benchmark by its file path;
and bench/README.md lists every benchmark module."""

import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"python3? (?:-\S+ )*-m (bench(?:\.\w+)+)")
BY_PATH = re.compile(r"python3? (?:-\S+ )*\S*bench/[\w/]+\.py")  # the form before modules
LIBRARIES = {
  "bench.common",
  "bench.dp.acco_quantized_cost",  # its main is the workers of bench.dp.acco_quantized --cost
  "bench.dp.convergence_settings",
  "bench.dp.perfmodel_figures",
  "bench.dp.perfmodel_loco",
  "bench.gpu.overlap_report",
  "bench.gpu.throughput_rows",
  "bench.gpu.torch_gpt",
  "bench.loco.traffic_cost",
  "bench.net.skippipe_prediction",
  "bench.pipeline.skippipe_sim",
}  # imported, not run
LIBRARY_PACKAGES = ("bench.loco.faults.",)  # the parts of bench.loco.store_faults


def documents() -> list[pathlib.Path]:
  return [
    REPO / "README.md",
    *sorted((REPO / "docs").rglob("*.md")),
    REPO / "bench" / "README.md",
    *sorted((REPO / "bench").rglob("*.py")),
  ]


def module_file(module: str) -> pathlib.Path:
  return REPO.joinpath(*module.split(".")).with_suffix(".py")


def documented() -> dict[str, list[str]]:
  """Module -> the documents whose commands run it."""
  out: dict[str, list[str]] = {}
  for doc in documents():
    for module in COMMAND.findall(doc.read_text()):
      out.setdefault(module, []).append(str(doc.relative_to(REPO)))
  return out


def test_no_command_runs_a_benchmark_by_its_path():
  old = {
    str(doc.relative_to(REPO)): found
    for doc in documents()
    if (found := BY_PATH.findall(doc.read_text()))
  }
  assert not old, f"commands that run a benchmark by path instead of python -m: {old}"


def test_documented_commands_name_modules_that_answer_help():
  modules = documented()
  assert len(modules) > 20, modules
  missing = {m: d for m, d in modules.items() if not module_file(m).is_file()}
  assert not missing, f"documented commands name modules that do not exist: {missing}"
  runner = (
    "import runpy, sys\n"
    "bad = []\n"
    "for name in sys.argv[1:]:\n"
    "  sys.argv = [name, '--help']\n"
    "  try:\n"
    "    runpy.run_module(name, run_name='__main__', alter_sys=True)\n"
    "    bad.append(name + ': no SystemExit from --help')\n"
    "  except SystemExit as e:\n"
    "    if e.code not in (0, None):\n"
    "      bad.append(f'{name}: --help exited {e.code}')\n"
    "print('BAD', bad)\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", runner, *sorted(modules)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "BAD []" in proc.stdout, proc.stdout[-3000:]


def test_bench_readme_lists_every_benchmark():
  listed = set(COMMAND.findall((REPO / "bench" / "README.md").read_text()))
  every = {
    ".".join(p.relative_to(REPO).with_suffix("").parts)
    for p in (REPO / "bench").rglob("*.py")
    if p.name != "__init__.py" and "results" not in p.parts
  } - LIBRARIES
  every = {m for m in every if not m.startswith(LIBRARY_PACKAGES)}
  assert every - listed == set(), f"bench/README.md does not list {sorted(every - listed)}"
