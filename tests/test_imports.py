"""The house has floors: no module of `sinkjax/` imports, directly or through others, a module that imports it.

The graph is built from the source with `ast`, not by importing: every `import` / `from ... import` statement counts,
at module level or inside a function (a function-level import is an edge all the same; it only runs later), relative
or absolute. `from sinkjax.p import x` is an edge to the submodule `sinkjax.p.x` when x is a module of the package,
else to `sinkjax.p` itself (x is a name its `__init__` defines, so that body must have run). A module that calls
`importlib.import_module` has an edge to each module of ours it names in a string (kernels.flash's backend table).
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import sinkjax

ROOT = pathlib.Path(sinkjax.__file__).parent


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  """{dotted module name: file} of every .py under the package (a package under its own name, from __init__.py)."""
  files = {}
  for path in sorted(root.rglob("*.py")):
    parts = (root.name,) + path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    files[".".join(parts)] = path
  return files


def _resolve(name: str, modules: set) -> str | None:
  """The longest prefix of `name` that is a module of ours (`sinkjax.config.ConfigError` -> `sinkjax.config`)."""
  parts = name.split(".")
  for n in range(len(parts), 0, -1):
    candidate = ".".join(parts[:n])
    if candidate in modules:
      return candidate
  return None


def import_edges(module: str, path: pathlib.Path, modules: set) -> list[tuple[str, int]]:
  """[(imported module of ours, line)] of every import statement in `path`, wherever it stands; in a module that
  calls `importlib.import_module`, every string constant naming a module of ours too (a backend table)."""
  is_package = path.name == "__init__.py"
  package = module if is_package else module.rpartition(".")[0]
  edges = []
  tree = ast.parse(path.read_text(), str(path))
  if any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(tree)):
    edges += [(n.value, n.lineno) for n in ast.walk(tree)
              if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in modules]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        target = _resolve(alias.name, modules)
        if target:
          edges.append((target, node.lineno))
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module or ""
      for alias in node.names:
        target = f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else _resolve(source, modules)
        if target:
          edges.append((target, node.lineno))
  return edges


def import_graph(root: pathlib.Path = ROOT) -> dict[str, dict[str, int]]:
  """{module: {module it imports: first line}} over `root`, self-imports left out."""
  files = module_files(root)
  modules = set(files)
  graph: dict[str, dict[str, int]] = {}
  for module, path in files.items():
    graph[module] = {}
    for target, line in import_edges(module, path, modules):
      if target != module:
        graph[module].setdefault(target, line)
  return graph


def strongly_connected(graph: dict[str, dict]) -> list[list[str]]:
  """Tarjan's strongly connected components with more than one module (each holds at least one cycle)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def a_cycle(graph: dict[str, dict], component: list[str]) -> list[str]:
  """One cycle through the component's first module, by breadth-first search inside the component: [a, b, ..., a]."""
  start, inside = component[0], set(component)
  parent = {start: None}
  frontier = [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(graph[v]):
        if w == start:
          path = [v]
          while parent[path[-1]] is not None:
            path.append(parent[path[-1]])
          return path[::-1] + [start]
        if w in inside and w not in parent:
          parent[w] = v
          nxt.append(w)
    frontier = nxt
  raise AssertionError(f"no cycle through {start} in its component")


def describe(graph: dict[str, dict], cycle: list[str]) -> str:
  return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_the_resolver_reads_every_form_of_import(tmp_path):
  """A hand-made package with each form: absolute, relative, `from pkg import module`, `from pkg import name`,
  function-level, a module named by a string for `importlib.import_module`; the edges found are exactly these."""
  pkg = tmp_path / "pkg"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "low.py").write_text("X = 1\n")
  (pkg / "sub" / "__init__.py").write_text("from pkg.sub import leaf\nNAME = 2\n")
  (pkg / "sub" / "leaf.py").write_text("from .. import low\n")
  (pkg / "mid.py").write_text("import pkg.low as l\nfrom pkg.sub import NAME\n\ndef f():\n  from .sub.leaf import g\n")
  (pkg / "top.py").write_text("from pkg import mid, low\nimport os\n")
  (pkg / "lazy.py").write_text("import importlib\nTABLE = {'a': 'pkg.mid', 'b': 'not.ours'}\n\n"
                               "def get(k):\n  return importlib.import_module(TABLE[k])\n")
  graph = import_graph(pkg)
  assert graph == {
      "pkg": {}, "pkg.low": {}, "pkg.sub": {"pkg.sub.leaf": 1}, "pkg.sub.leaf": {"pkg.low": 1},
      "pkg.mid": {"pkg.low": 1, "pkg.sub": 2, "pkg.sub.leaf": 5}, "pkg.top": {"pkg.mid": 1, "pkg.low": 1},
      "pkg.lazy": {"pkg.mid": 2}}
  assert strongly_connected(graph) == []


def test_a_cycle_is_found_and_named(tmp_path):
  """Three modules in a ring through a function-level import (the kind of cycle an import at the bottom hides)."""
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from pkg import b\n")
  (pkg / "b.py").write_text("from pkg.c import thing\n")
  (pkg / "c.py").write_text("thing = 1\n\ndef later():\n  import pkg.a\n")
  (pkg / "d.py").write_text("import pkg.a\n")
  graph = import_graph(pkg)
  components = strongly_connected(graph)
  assert components == [["pkg.a", "pkg.b", "pkg.c"]]
  assert a_cycle(graph, components[0]) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
  assert describe(graph, ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]) == \
      "pkg.a (line 1) -> pkg.b (line 1) -> pkg.c (line 4) -> pkg.a"


def test_sinkjax_has_no_import_cycle():
  graph = import_graph()
  assert len(graph) > 50 and "sinkjax.kinds.gated" in graph
  components = strongly_connected(graph)
  cycles = [f"{len(c)} modules in a circle ({', '.join(c)}), e.g. {describe(graph, a_cycle(graph, c))}"
            for c in components]
  assert not cycles, "import cycles in sinkjax/ (a module must import only modules below it):\n" + "\n".join(cycles)


def _below(graph: dict[str, dict], module: str) -> set:
  """Every module `module` imports, directly or through others."""
  seen, stack = set(), [module]
  while stack:
    for w in graph[stack.pop()]:
      if w not in seen:
        seen.add(w)
        stack.append(w)
  return seen


def test_the_floors_of_the_kinds_and_the_config():
  """The kind registry is the floor (it imports nothing of sinkjax); the config reaches no kind, only the registry
  and the jax-free modules beside it (errors, choices, paths); the sharding, the cache, the kernels and Gated DeltaNet reach no config; the built-in
  kinds are registered from above: the variants by layers, the mixers by model."""
  graph = import_graph()
  assert graph["sinkjax.kinds"] == {}
  kinds = {m for m in graph if m.startswith("sinkjax.kinds.")}
  assert _below(graph, "sinkjax.config") <= {"sinkjax.errors", "sinkjax.choices", "sinkjax.paths", "sinkjax.kinds"}
  for module in ("sinkjax.sharding", "sinkjax.cache", "sinkjax.kernels", "sinkjax.deltanet", "sinkjax.attention"):
    assert not _below(graph, module) & ({"sinkjax.config"} | kinds), module
  assert {"sinkjax.kinds.vanilla", "sinkjax.kinds.sink", "sinkjax.kinds.gated", "sinkjax.kinds.relu"} <= \
      set(graph["sinkjax.layers"])
  assert {"sinkjax.kinds.attention_layer", "sinkjax.kinds.linear"} <= set(graph["sinkjax.model"])


def test_a_config_loads_without_jax_and_a_standalone_layer_runs_every_builtin_variant():
  """In a fresh interpreter: loading a config imports no jax (the registry it asks imports nothing); importing
  `sinkjax.layers` alone registers the four variants (`Attention(..., attention=...)` needs nothing else)."""
  code = ("import sys\nfrom sinkjax.config import load_config\nload_config(None, ['model.attention=gated'])\n"
          "assert 'jax' not in sys.modules, 'config imported jax'\n"
          "from flax import nnx\nfrom sinkjax.layers import Attention\n"
          "for a in ('vanilla', 'sink', 'gated', 'relu'):\n  Attention(16, 2, attention=a, rngs=nnx.Rngs(0))\n"
          "assert 'sinkjax.model' not in sys.modules\nprint('ok')\n")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
