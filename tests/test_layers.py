"""The package's layers: each module imports only from its own layer and those below it.

core < data < models < methods < config_files < recipes < training, search < jobs < main
(docs/design.md). training and search share a floor and do not import each
other; a method module imports no other method, a job no other job; no
module uses another's private (underscored) names; every implementation of the
data `Source` protocol is in data/; the TF-free set (docs/design.md, 'Without
TensorFlow') imports no TensorFlow, TFDS or clu at module level and nothing of
the package outside the set. The imports are read from the source with ast, so
the rules hold for every module, imported at run time or not; the checkers
themselves are tested on a small tree that breaks each rule.
"""

import ast
import os

from without_tensorflow_worker import tf_free_modules

PACKAGE = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contrastive_jax"
)
# Bottom to top; the packages of one floor may not import each other.
LAYERS = (
  ("core",),
  ("data",),
  ("models",),
  ("methods",),
  ("config_files",),
  ("recipes",),
  ("training", "search"),
  ("jobs",),
  ("main",),
)
# The modules of methods/ that are not a method: what every method shares.
METHOD_SHARED = ("common", "optim")
# What the TF-free set may not import at module level (clu's writers import TensorFlow).
TF_PACKAGES = ("tensorflow", "tensorflow_datasets", "clu")


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


def _module_paths(root: str, name: str = "contrastive_jax") -> dict:
  """{dotted module name: path} of every .py under root (a package by its __init__.py)."""
  paths = {}
  for directory, _, files in os.walk(root):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(directory, f), root)[:-3].split(os.sep)
        paths[".".join([name, *(rel[:-1] if rel[-1] == "__init__" else rel)])] = os.path.join(
          directory, f
        )
  return paths


def _parse(path: str) -> ast.Module:
  with open(path) as f:
    return ast.parse(f.read(), path)


def source_methods(root: str) -> set:
  """The method names of the Source protocol (class Source of root/data/sources.py)."""
  tree = _parse(os.path.join(root, "data", "sources.py"))
  [protocol] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Source"]
  return {n.name for n in protocol.body if isinstance(n, ast.FunctionDef)}


def sources_outside_data(root: str, name: str = "contrastive_jax") -> list:
  """'module.Class' of every class outside data/ that implements the Source protocol: it
  defines all of the protocol's methods, or names Source among its bases."""
  wanted, found = source_methods(root), []
  for module, path in sorted(_module_paths(root, name).items()):
    if package(module) == "data":
      continue
    for node in ast.walk(_parse(path)):
      if not isinstance(node, ast.ClassDef):
        continue
      methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
      bases = {ast.unparse(b).split(".")[-1] for b in node.bases}
      if wanted <= methods or "Source" in bases:
        found.append(f"{module}.{node.name}")
  return found


def _module_level_imports(statements) -> list:
  """The top package of every import run when the module is imported: its statements, their
  blocks (if, try, with, class bodies), not function bodies."""
  found = []
  for node in statements:
    if isinstance(node, ast.Import):
      found += [a.name.split(".")[0] for a in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level:
      found.append((node.module or "").split(".")[0])
    elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      for field in ("body", "orelse", "finalbody", "handlers"):
        found += _module_level_imports(getattr(node, field, []))
  return found


def tf_free_violations(root: str, tf_free: list, name: str = "contrastive_jax") -> list:
  """Lines for the TF-free set: a name of it that is no module, a module of it that imports
  one of TF_PACKAGES at module level, or a module of the package outside the set."""
  paths, graph, found = _module_paths(root, name), modules(root, name), []
  for module in tf_free:
    if module not in paths:
      found.append(f"{module} (TF-free set) is no module")
      continue
    for top in sorted(set(_module_level_imports(_parse(paths[module]).body)) & set(TF_PACKAGES)):
      found.append(f"{module} (TF-free set) imports {top}")
    for imported in sorted(graph[module] - set(tf_free)):
      found.append(f"{module} (TF-free set) imports {imported}, which is not in the set")
  return found


def test_every_source_implementation_is_in_data():
  assert sources_outside_data(PACKAGE) == []


def test_the_tf_free_set_imports_no_tensorflow_and_only_itself():
  tf_free = tf_free_modules(PACKAGE)
  assert "contrastive_jax.training.runner" in tf_free and "contrastive_jax.core" in tf_free
  assert tf_free_violations(PACKAGE, tf_free) == []


def test_the_source_and_tf_free_checkers_find_each_violation(tmp_path):
  root = tmp_path / "contrastive_jax"
  for rel, text in {
    "__init__.py": "",
    "core/__init__.py": "",
    "core/a.py": "import json\ndef f():\n  import tensorflow\n",
    "core/b.py": "try:\n  import tensorflow_datasets as tfds\nexcept ImportError:\n  pass\n",
    "core/c.py": "from clu import metric_writers\n",
    "data/__init__.py": "",
    "data/sources.py": (
      "class Source:\n  def read(self): ...\n  def num_examples(self): ...\n"
      "class TfdsSource:\n  def read(self): ...\n  def num_examples(self): ...\n"
    ),
    "data/d.py": "from contrastive_jax.core import a\n",
    "data/e.py": "from contrastive_jax.data import sources\n",
    "jobs/__init__.py": "",
    "jobs/f.py": (
      "class Cells:\n  def read(self): ...\n"
      "class InMemory:\n  def read(self): ...\n  def num_examples(self): ...\n"
      "class Sub(sources.Source):\n  pass\n"
    ),
  }.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
  assert sources_outside_data(str(root)) == [
    "contrastive_jax.jobs.f.InMemory",
    "contrastive_jax.jobs.f.Sub",
  ]
  tf_free = ["contrastive_jax.core.a", "contrastive_jax.core.b", "contrastive_jax.core.c"]
  tf_free += ["contrastive_jax.data.d", "contrastive_jax.data.e", "contrastive_jax.data.g"]
  assert tf_free_violations(str(root), tf_free) == [
    "contrastive_jax.core.b (TF-free set) imports tensorflow_datasets",
    "contrastive_jax.core.c (TF-free set) imports clu",
    "contrastive_jax.data.e (TF-free set) imports contrastive_jax.data.sources, which is not in "
    "the set",
    "contrastive_jax.data.g (TF-free set) is no module",
  ]


# The process settings have one home, core/runtime.py (with the two modules it runs):
# no other module writes their environment variables or re-executes the process, and
# every entry point calls runtime.setup().
REPOSITORY = os.path.dirname(PACKAGE)
PROCESS_SETTINGS = ("XLA_FLAGS", "GLIBC_TUNABLES", "TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")
PROCESS_SETTERS = ("core/runtime.py", "core/host_memory.py")


def process_setting_writes(path: str) -> list:
  """'path:line' of each write in path's source to a PROCESS_SETTINGS variable of
  os.environ (item assignment or deletion, setdefault, update, pop, os.putenv) and each
  os.exec* call or reexec_with_huge_pages call."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  found = []
  for node in ast.walk(tree):
    targets = []
    if isinstance(node, (ast.Assign, ast.Delete)):
      targets = node.targets
    elif isinstance(node, ast.AugAssign):
      targets = [node.target]
    names = [
      t.slice.value
      for t in targets
      if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
    ]
    if isinstance(node, ast.Call):
      attr = getattr(node.func, "attr", "") or getattr(node.func, "id", "")
      if attr in ("setdefault", "update", "pop", "putenv"):
        names = [c.value for a in node.args for c in ast.walk(a) if isinstance(c, ast.Constant)]
      elif attr.startswith("exec") and getattr(node.func.value, "id", None) == "os":
        names = ["os." + attr]
      elif attr == "reexec_with_huge_pages":
        names = [attr]
    if any(n in PROCESS_SETTINGS or str(n).startswith(("os.exec", "reexec")) for n in names):
      found.append(f"{os.path.relpath(path, REPOSITORY)}:{node.lineno}")
  return found


def entry_points() -> list:
  """main.py, tests/conftest.py and every script of benchmarks/ (a module that runs
  under `if __name__ == "__main__"`)."""
  found = [os.path.join(PACKAGE, "main.py"), os.path.join(REPOSITORY, "tests", "conftest.py")]
  benchmarks = os.path.join(REPOSITORY, "benchmarks")
  for f in sorted(os.listdir(benchmarks)):
    with open(os.path.join(benchmarks, f)) as source:
      if f.endswith(".py") and 'if __name__ == "__main__"' in source.read():
        found.append(os.path.join(benchmarks, f))
  return found


def calls_setup(path: str) -> bool:
  """Whether path's source calls runtime.setup(...)."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  return any(
    isinstance(node, ast.Call)
    and getattr(node.func, "attr", None) == "setup"
    and getattr(node.func.value, "id", None) == "runtime"
    for node in ast.walk(tree)
  )


def test_the_process_is_set_up_in_one_place_that_every_entry_point_calls():
  paths = [
    os.path.join(d, f)
    for top in (PACKAGE, os.path.join(REPOSITORY, "benchmarks"))
    for d, _, files in os.walk(top)
    for f in files
    if f.endswith(".py")
  ] + [os.path.join(REPOSITORY, "tests", "conftest.py")]
  setters = tuple(os.path.join(PACKAGE, *p.split("/")) for p in PROCESS_SETTERS)
  writes = [line for p in paths if p not in setters for line in process_setting_writes(p)]
  assert writes == [], writes
  assert len(entry_points()) > 3
  assert [p for p in entry_points() if not calls_setup(p)] == []


def test_the_process_setting_checker_finds_each_write(tmp_path):
  path = tmp_path / "m.py"
  path.write_text(
    "import os\n"
    'os.environ["XLA_FLAGS"] = "-x"\n'
    'os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")\n'
    'os.environ.update({"GLIBC_TUNABLES": "a=1"})\n'
    "os.execv(sys.executable, [])\n"
    "host_memory.reexec_with_huge_pages()\n"
    'os.environ["OTHER"] = "1"\n'
    'print(os.environ.get("XLA_FLAGS"))\n'
  )
  assert [line.split(":")[1] for line in process_setting_writes(str(path))] == list("23456")
  path.write_text("from contrastive_jax.core import runtime\nruntime.setup(huge_pages=False)\n")
  assert calls_setup(str(path))
