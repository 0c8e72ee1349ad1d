"""The package's layers: each module imports only from its own layer and those below it.

core < data < models < methods < recipes < jobs < main (docs/design.md). The
imports are read from the source with ast, so the rule holds for every
module, imported at run time or not; the checker itself is tested on a small
tree with an upward import and a cycle.
"""
import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "contrastive_jax")
LAYERS = ("core", "data", "models", "methods", "recipes", "jobs", "main")
METHOD_MODULES = ("simclr", "moco", "mocov3", "byol")


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
          parts = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(parts + ([node.module] if node.module else []))
        if base.split(".")[0] == name:
          for alias in node.names:
            sub = f"{base}.{alias.name}"
            imported.add(sub if sub in paths else base)
      elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).split(".")[0] == name):
        imported.add(node.args[0].value)
    graph[module] = imported - {module}
  return graph


def layer(module: str) -> int:
  """The rank in LAYERS of contrastive_jax.<layer>[...]; the package root is the bottom."""
  parts = module.split(".")
  return LAYERS.index(parts[1]) if len(parts) > 1 else -1


def violations(graph: dict) -> list:
  """Human-readable lines: upward imports, a method importing another, import cycles."""
  found = [f"{m} (layer {LAYERS[layer(m)]}) imports {i} (layer {LAYERS[layer(i)]})"
           for m, imported in graph.items() for i in imported if layer(i) > layer(m)]
  for m, imported in graph.items():
    if m.split(".")[-1] in METHOD_MODULES and m.split(".")[-2] == "methods":
      found += [f"{m} imports another method, {i}" for i in imported
                if i.split(".")[-1] in METHOD_MODULES]
  state = {}

  def visit(m, stack):
    state[m] = "open"
    for i in sorted(graph.get(m, ())):
      if state.get(i) == "open":
        found.append("import cycle: " + " -> ".join(stack[stack.index(i):] + [i]))
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
      assert module.split(".")[1] in LAYERS, f"{module} is in no layer of {LAYERS}"


def test_no_module_imports_from_a_layer_above_it_and_there_are_no_cycles():
  assert violations(modules(PACKAGE)) == []


def test_the_checker_finds_an_upward_import_a_method_import_and_a_cycle(tmp_path):
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
  }.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
  found = violations(modules(str(root)))
  assert "contrastive_jax.data.c (layer data) imports contrastive_jax.jobs.d (layer jobs)" in found
  assert ("contrastive_jax.methods.simclr imports another method, contrastive_jax.methods.byol"
          in found)
  assert any(line.startswith("import cycle: contrastive_jax.core.a -> contrastive_jax.core.b")
             for line in found)
  assert "contrastive_jax.data.e (layer data) imports contrastive_jax.jobs.d (layer jobs)" in found
  assert "contrastive_jax.data.f (layer data) imports contrastive_jax.jobs.d (layer jobs)" in found
  assert len(found) == 5, found

