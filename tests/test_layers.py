"""The package's layers: each module imports only from its own layer and those below it.

core < data < models < methods < recipes < training, search < jobs < main
(docs/design.md). training and search share a floor and do not import each
other; a method module imports no other method, a job no other job; no
module uses another's private (underscored) names. The imports are read from
the source with ast, so the rules hold for every module, imported at run time
or not; the checker itself is tested on a small tree that breaks each rule.
"""

import ast
import os

PACKAGE = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contrastive_jax"
)
# Bottom to top; the packages of one floor may not import each other.
LAYERS = (
  ("core",),
  ("data",),
  ("models",),
  ("methods",),
  ("recipes",),
  ("training", "search"),
  ("jobs",),
  ("main",),
)
# The modules of methods/ that are not a method: what every method shares.
METHOD_SHARED = ("common", "optim")


def modules(root: str, name: str = "contrastive_jax") -> dict:
  """{dotted module name: set of the package's modules it imports} for every .py under root.

  `from P import X` counts as an import of P.X when that is a module, else of P;
  relative imports are resolved, and importlib.import_module('...') of a literal
  name counts too.
  """
  paths, packages = {}, set()
  for directory, _, files in os.walk(root):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(directory, f), root)[:-3].split(os.sep)
        if rel[-1] == "__init__":
          rel = rel[:-1]
          packages.add(".".join([name, *rel]))
        paths[".".join([name, *rel])] = os.path.join(directory, f)
  graph = {}
  for module, path in paths.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    imported = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        imported.update(a.name for a in node.names if a.name.split(".")[0] == name)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # Relative: from the module's own package, up level - 1.
          package = module if module in packages else module.rsplit(".", 1)[0]
          parts = package.split(".")[: len(package.split(".")) - node.level + 1]
          base = ".".join(parts + ([node.module] if node.module else []))
        if base.split(".")[0] == name:
          for alias in node.names:
            sub = f"{base}.{alias.name}"
            imported.add(sub if sub in paths else base)
      elif (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", None) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and str(node.args[0].value).split(".")[0] == name
      ):
        imported.add(node.args[0].value)
    graph[module] = imported - {module}
  return graph


def private_uses(root: str, name: str = "contrastive_jax") -> list:
  """'module uses other._name' lines: a package module's underscored name used by another.

  Counts `from contrastive_jax.X import _name` and `alias._name` where alias is
  bound by an import of a package module.
  """
  found = []
  for directory, _, files in os.walk(root):
    for f in files:
      if not f.endswith(".py"):
        continue
      path = os.path.join(directory, f)
      with open(path) as source:
        tree = ast.parse(source.read(), path)
      module = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
      aliases = {}
      for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(name):
          for alias in node.names:
            if alias.name.startswith("_"):
              found.append(f"{module} uses {node.module}.{alias.name}")
            aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
          for alias in node.names:
            if alias.name.startswith(name) and alias.asname:
              aliases[alias.asname] = alias.name
      for node in ast.walk(tree):
        if (
          isinstance(node, ast.Attribute)
          and isinstance(node.value, ast.Name)
          and node.value.id in aliases
          and node.attr.startswith("_")
          and not node.attr.startswith("__")
        ):
          found.append(f"{module} uses {aliases[node.value.id]}.{node.attr}")
  return found


def layer(module: str) -> int:
  """The floor in LAYERS of contrastive_jax.<package>[...]; the package root is the bottom."""
  parts = module.split(".")
  if len(parts) == 1:
    return -1
  return next(rank for rank, packages in enumerate(LAYERS) if parts[1] in packages)


def package(module: str) -> str:
  """The top package under contrastive_jax (e.g. 'jobs'), '' for the root."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def violations(graph: dict) -> list:
  """Human-readable lines: imports upward or across a floor, a method importing another
  method, a job importing another job, import cycles."""
  found = []
  for m, imported in graph.items():
    for i in imported:
      if layer(i) > layer(m):
        found.append(f"{m} (layer {package(m)}) imports {i} (layer {package(i)})")
      elif layer(i) == layer(m) and package(i) != package(m):
        found.append(f"{m} (layer {package(m)}) imports {i} (layer {package(i)}, the same floor)")
  for m, imported in graph.items():
    parts = m.split(".")
    if len(parts) == 3 and parts[1] == "methods" and parts[2] not in METHOD_SHARED:
      found += [
        f"{m} imports another method, {i}"
        for i in imported
        if len(i.split(".")) == 3
        and i.split(".")[1] == "methods"
        and i.split(".")[2] not in METHOD_SHARED
      ]
    if len(parts) == 3 and parts[1] == "jobs":
      found += [
        f"{m} imports another job, {i}"
        for i in imported
        if len(i.split(".")) == 3 and i.split(".")[1] == "jobs"
      ]
  state = {}

  def visit(m, stack):
    state[m] = "open"
    for i in sorted(graph.get(m, ())):
      if state.get(i) == "open":
        found.append("import cycle: " + " -> ".join(stack[stack.index(i) :] + [i]))
      elif i not in state:
        visit(i, stack + [i])
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  return found


def test_every_module_belongs_to_a_layer():
  for module in modules(PACKAGE):
    if module != "contrastive_jax":
      assert any(module.split(".")[1] in packages for packages in LAYERS), (
        f"{module} is in no layer of {LAYERS}"
      )


def test_no_module_imports_from_a_layer_above_it_and_there_are_no_cycles():
  assert violations(modules(PACKAGE)) == []


def test_no_module_uses_another_modules_private_names():
  assert private_uses(PACKAGE) == []


def test_the_checker_finds_each_kind_of_violation(tmp_path):
  root = tmp_path / "contrastive_jax"
  for rel, text in {
    "__init__.py": "",
    "core/__init__.py": "",
    "core/a.py": "from contrastive_jax.core import b\n",
    "core/b.py": "from contrastive_jax.core import a\n",
    "data/__init__.py": "",
    "data/c.py": "import contrastive_jax.jobs.d\n",
    "data/e.py": "def f():\n  from ..jobs import d\n",
    "data/f.py": "import importlib\nimportlib.import_module('contrastive_jax.jobs.d')\n",
    "jobs/__init__.py": "",
    "jobs/d.py": "from contrastive_jax.core.a import something\n",
    "methods/__init__.py": "",
    "methods/simclr.py": "from contrastive_jax.methods import byol\n",
    "methods/byol.py": "",
    "methods/common.py": "",
    "methods/moco.py": "from contrastive_jax.methods import common\n",
    "training/__init__.py": "",
    "training/t.py": "from contrastive_jax.search import s\n",
    "search/__init__.py": "",
    "search/s.py": "from contrastive_jax.core import a as a_lib\nx = a_lib._hidden\n",
    "jobs/g.py": "from contrastive_jax.jobs import d\nfrom contrastive_jax.core.b import _y\n",
  }.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
  found = violations(modules(str(root)))
  assert "contrastive_jax.data.c (layer data) imports contrastive_jax.jobs.d (layer jobs)" in found
  assert (
    "contrastive_jax.methods.simclr imports another method, contrastive_jax.methods.byol" in found
  )
  assert any(
    line.startswith("import cycle: contrastive_jax.core.a -> contrastive_jax.core.b")
    for line in found
  )
  assert "contrastive_jax.data.e (layer data) imports contrastive_jax.jobs.d (layer jobs)" in found
  assert "contrastive_jax.data.f (layer data) imports contrastive_jax.jobs.d (layer jobs)" in found
  assert (
    "contrastive_jax.training.t (layer training) imports contrastive_jax.search.s (layer "
    "search, the same floor)"
  ) in found
  assert "contrastive_jax.jobs.g imports another job, contrastive_jax.jobs.d" in found
  assert len(found) == 7, found  # methods.moco may import methods.common.
  assert sorted(private_uses(str(root))) == [
    "contrastive_jax.jobs.g uses contrastive_jax.core.b._y",
    "contrastive_jax.search.s uses contrastive_jax.core.a._hidden",
  ]


def sources_outside_data(root: str) -> list:
  """Classes outside data/ that define Source's reading methods (process_counts and read):
  every data source lives in the data layer."""
  found = []
  for directory, _, names in os.walk(root):
    for f in names:
      path = os.path.join(directory, f)
      if not f.endswith(".py") or os.path.relpath(path, root).split(os.sep)[0] == "data":
        continue
      with open(path) as text:
        tree = ast.parse(text.read(), path)
      for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
          defined = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
          if {"process_counts", "read"} <= defined:
            found.append(f"{os.path.relpath(path, root)}: {node.name}")
  return found


def test_every_data_source_is_in_the_data_layer(tmp_path):
  assert sources_outside_data(PACKAGE) == []
  (tmp_path / "jobs").mkdir()
  (tmp_path / "jobs" / "j.py").write_text(
    "class Part:\n  def process_counts(self):\n    pass\n\n  def read(self):\n    pass\n"
  )
  assert sources_outside_data(str(tmp_path)) == ["jobs/j.py: Part"]
