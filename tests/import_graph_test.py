"""One-way imports: the run shell imports no family, a family imports of another only what that
one declares shared (``SHARED`` in its ``__init__``), the import graph has no cycle, the
algorithms reach no module of the shell, and neither do the families the shell builds runs of
(``dp``, ``loco``, ``pipeline``; ``ensemble`` drives the shell).

Every ``import`` statement counts, also one inside a function (a lazy import is still an edge).
The implicit import of a module's parent packages does not: ``acco_jax/__init__`` registers the
families (:mod:`acco_jax.families`), which every module of the package would otherwise reach.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAMILIES = ("dp", "loco", "pipeline", "ensemble")


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in (ROOT / "acco_jax").rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def import_graph() -> dict[str, set[str]]:
  """Module -> the acco_jax modules it imports (``from pkg import sub`` names the submodule)."""
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        edges.update(a.name for a in node.names if a.name in modules)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          up = package.split(".")[: len(package.split(".")) - node.level + 1]
          base = ".".join(up + ([base] if base else []))
        for alias in node.names:
          sub = f"{base}.{alias.name}"
          edges.add(sub if sub in modules else base)
    graph[name] = {e for e in edges if e in modules and e != name}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of ``graph`` as a list of modules (first == last), or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_the_run_shell_imports_no_family():
  upward = {
    name: sorted(e for e in edges if e.split(".")[1:2] and e.split(".")[1] in FAMILIES)
    for name, edges in import_graph().items()
    if name.startswith("acco_jax.run")
  }
  assert not {k: v for k, v in upward.items() if v}, (
    "acco_jax/run reaches the families only through acco_jax.run.registry"
  )


def test_the_import_graph_has_no_cycle():
  assert find_cycle(import_graph()) is None


def test_find_cycle_sees_one():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def shared() -> dict[str, tuple[str, ...]]:
  """Family -> the modules it declares shared (``SHARED = (...)`` in its ``__init__.py``)."""
  out = {}
  for family in FAMILIES:
    tree = ast.parse((ROOT / "acco_jax" / family / "__init__.py").read_text())
    found = [
      ast.literal_eval(node.value)
      for node in tree.body
      if isinstance(node, ast.Assign)
      and any(getattr(t, "id", None) == "SHARED" for t in node.targets)
    ]
    assert len(found) == 1, f"acco_jax/{family}/__init__.py declares no SHARED tuple"
    out[family] = tuple(found[0])
  return out


def across_families(graph: dict[str, set[str]], declared: dict[str, tuple]) -> dict[str, list]:
  """Module -> the modules of other families it imports that those do not declare shared."""

  def family(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FAMILIES else None

  out = {}
  for name, edges in graph.items():
    bad = sorted(
      e
      for e in edges
      if family(e)
      and family(name)
      and family(e) != family(name)
      and e.split(".")[2:3] != []
      and e.split(".")[2] not in declared[family(e)]
    )
    if bad:
      out[name] = bad
  return out


def test_no_family_imports_another_beyond_what_it_shares():
  """The data-parallel family shares its step and transforms; the pipeline and LoCo share nothing
  (SkipPipe's scheduler and layer orders live below both, in acco_jax/skippipe)."""
  graph, declared = import_graph(), shared()
  assert across_families(graph, declared) == {}
  assert declared["pipeline"] == () and declared["loco"] == ()
  # the edge the data-parallel build had while the layer orders lived in the pipeline family
  old = {**graph, "acco_jax.dp.build": graph["acco_jax.dp.build"] | {"acco_jax.pipeline.orders"}}
  assert across_families(old, declared) == {"acco_jax.dp.build": ["acco_jax.pipeline.orders"]}
  assert not any(e.startswith("acco_jax.pipeline") for e in graph["acco_jax.skippipe.orders"])


# The algorithms: optax transforms and LoCo methods, pure functions of arrays. They reach no module
# of the run shell (acco_jax.run), directly or through another, and no Flax, orbax, TFDS or grain.
ALGORITHMS = (
  "acco_jax.dp.methods",
  "acco_jax.dp.updates",
  "acco_jax.dp.quantize",
  "acco_jax.dp.layouts",
  "acco_jax.loco.base",
  "acco_jax.loco.diloco",
  "acco_jax.loco.streaming",
  "acco_jax.loco.noloco",
  "acco_jax.loco.sparseloco",
  "acco_jax.loco.demo",
  "acco_jax.loco.compress",
)
SHELL_LIBRARIES = ("flax", "orbax", "tensorflow_datasets", "grain")


def _reached(graph, start: str) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    for nxt in graph[todo.pop()] - seen:
      seen.add(nxt)
      todo.append(nxt)
  return seen


def _libraries(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      names.add(node.module.split(".")[0])
  return names


def test_the_algorithms_reach_no_shell_and_no_shell_library():
  graph, modules = import_graph(), _modules()
  for name in ALGORITHMS:
    reached = _reached(graph, name) | {name}
    shell = sorted(m for m in reached if m.startswith("acco_jax.run"))
    assert not shell, f"{name} reaches the run shell through {shell}"
    libraries = {m: _libraries(modules[m]) & set(SHELL_LIBRARIES) for m in reached}
    assert not {m: v for m, v in libraries.items() if v}, f"{name} reaches {libraries}"


# The families that build a run the trainer drives (dp, loco, pipeline) and SkipPipe's paths below
# them reach no module of the run shell, directly or through another: a family describes itself
# and builds its run against acco_jax.family_api (Family, Run), steps against acco_jax.step_api,
# checkpoints against acco_jax.ckpt, and the config's optimizer and mesh come from acco_jax.optim
# and acco_jax.parallel, all below the shell; the shell hands a build the model's config. HDEE
# (ensemble) is the one family that drives the shell: its recipe runs the trainer once per expert.
BUILT_BY_THE_SHELL = ("dp", "loco", "pipeline", "skippipe")


def _families_reaching_the_shell(graph) -> dict[str, list[str]]:
  out = {}
  for name in sorted(graph):
    if name.split(".")[1:2] and name.split(".")[1] in BUILT_BY_THE_SHELL:
      bad = sorted(m for m in _reached(graph, name) if m.startswith("acco_jax.run"))
      if bad:
        out[name] = bad
  return out


def test_the_families_reach_no_module_of_the_shell():
  graph = import_graph()
  assert _families_reaching_the_shell(graph) == {}
  assert {"acco_jax.dp.build", "acco_jax.loco.family", "acco_jax.pipeline.build"} <= set(graph)
  # imports the families had before: dp's step's byte count from the shell's metrics, each
  # build's Run and model config from the shell's build, the registry's Family; and a module
  # reaching one that reaches the shell is seen
  for module, old in (
    ("acco_jax.dp.step", "acco_jax.run.metrics"),
    ("acco_jax.dp.build", "acco_jax.run.build"),
    ("acco_jax.loco.family", "acco_jax.run.registry"),
    ("acco_jax.family_api", "acco_jax.run.build"),
  ):
    found = _families_reaching_the_shell({**graph, module: graph[module] | {old}})
    assert found, (module, old)
    if module.startswith("acco_jax.family_api"):
      assert "acco_jax.dp.family" in found, found
    else:
      assert old in found[module], (module, old)


def test_the_checkpoints_package_reaches_no_shell_and_no_family():
  """acco_jax/ckpt sits below the run shell and the families: dp/ and the pipeline import its
  portable form and its checkpointer without reaching acco_jax.run."""
  graph = import_graph()
  ckpt = sorted(m for m in graph if m == "acco_jax.ckpt" or m.startswith("acco_jax.ckpt."))
  assert {"acco_jax.ckpt.checkpoint", "acco_jax.ckpt.meta", "acco_jax.ckpt.portable"} <= set(ckpt)

  def reaching(graph):
    out = {}
    for name in ckpt:
      bad = sorted(
        m
        for m in _reached(graph, name)
        if m.startswith("acco_jax.run") or m.split(".")[1:2] and m.split(".")[1] in FAMILIES
      )
      if bad:
        out[name] = bad
    return out

  assert reaching(graph) == {}
  # the import meta.py's schema had while it sat in run/build.py is one this test sees
  old = {**graph, "acco_jax.ckpt.meta": graph["acco_jax.ckpt.meta"] | {"acco_jax.run.build"}}
  assert "acco_jax.run.build" in reaching(old)["acco_jax.ckpt.meta"]
