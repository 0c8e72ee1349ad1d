"""The docs name what the code has: every job of main.JOBS has a command in the README's jobs
table and a line in docs/jobs.md, and every config file the README or docs/jobs.md names exists;
docs/design.md's layer table names every module of the package as it is on disk, and its jobs
row every job; no doc names a tracker issue."""

import ast
import os
import re

from contrastive_jax import config_files
from contrastive_jax import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(rel: str) -> str:
  with open(os.path.join(ROOT, rel)) as f:
    return f.read()


def _jobs_table(readme: str) -> list:
  """The rows ('| job | command |') of the README's section '## Jobs'."""
  section = readme.split("\n## Jobs\n", 1)[1].split("\n## ", 1)[0]
  return [line for line in section.splitlines() if line.startswith("| ") and "`" in line]


def _config_jobs(text: str) -> set:
  """config.job of each `--config=configs/X.py[:ARGS]` in text (loaded as main.py loads it)."""
  found = set()
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    for value in re.findall(r"--config=(configs/[\w.]+\.py(?::[\w=,.]+)?)", text):
      found.add(config_files.load_config_file(value, "--config").job)
  finally:
    os.chdir(cwd)
  return found


def test_every_job_has_a_command_in_the_readmes_jobs_table():
  rows = _jobs_table(_read("README.md"))
  assert set(main.JOBS) <= _config_jobs("\n".join(rows)), (sorted(main.JOBS), rows)


def test_every_job_is_named_in_docs_jobs_md():
  text = _read("docs/jobs.md")
  missing = [job for job in main.JOBS if f"`{job}`" not in text]
  assert not missing, f"docs/jobs.md names no job {missing}"


def _layer_table() -> dict:
  """{layer: [module paths relative to contrastive_jax/]} from docs/design.md's layer table.

  A row names its modules in backticks: 'core/errors.py', then 'metrics.py' for
  another module of the same package (the folder of the last name with one).
  """
  section = _read("docs/design.md").split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
  table = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) < 3 or not cells[1].startswith("`"):
      continue
    folder, modules = "", []
    for name in re.findall(r"`([\w/]+\.py)`", cells[1]):
      if "/" in name:
        folder = os.path.dirname(name)
      modules.append(os.path.join(folder, os.path.basename(name)))
    table[cells[0]] = modules
  return table


def _package_modules() -> set:
  """Every module of contrastive_jax/ as it is on disk now, relative to it; a package's
  __init__.py only where it holds more than its docstring."""
  package = os.path.join(ROOT, "contrastive_jax")
  found = set()
  for folder, _, names in os.walk(package):
    for name in names:
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      if name == "__init__.py":
        with open(path) as f:
          body = ast.parse(f.read()).body
        if all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body):
          continue
      found.add(os.path.relpath(path, package))
  return found


def test_design_md_layer_table_names_every_module_and_only_modules_that_exist():
  table = _layer_table()
  assert {"core", "data", "models", "methods", "recipes", "training", "jobs", "main"} <= set(table)
  named = [m for modules in table.values() for m in modules]
  modules = _package_modules()
  assert not modules - set(named), f"docs/design.md's layer table misses {modules - set(named)}"
  gone = [m for m in named if not os.path.exists(os.path.join(ROOT, "contrastive_jax", m))]
  assert not gone, f"docs/design.md's layer table names modules that do not exist: {gone}"
  for layer, modules in table.items():  # Each module in the row of its layer.
    assert all(m.split("/")[0] in (layer, m) for m in modules), (layer, modules)


def test_design_md_jobs_row_names_every_job_of_main():
  jobs = set(_layer_table()["jobs"])
  for name, module in main.JOBS.items():
    path = module.__name__.removeprefix("contrastive_jax.").replace(".", "/") + ".py"
    assert path in jobs, f"docs/design.md's jobs row does not name {path} (job {name!r})"


# 'issue 17', 'issues 3 and 4', 'issue #17': a tracker's issue, which a reader of the
# docs cannot open. Another project's issue named with its project ('faiss issue #2700')
# is a public reference and stays.
_TRACKER_ISSUE = re.compile(r"(\w+ )?\bissues? #?\d+", re.IGNORECASE)
_OTHER_PROJECTS = {"faiss", "jax", "flax", "orbax", "tensorflow", "xla", "pytorch", "beam"}


def _text_files():
  """README.md, docs/*.md and the .py files of the package, configs/ and benchmarks/."""
  yield "README.md"
  for folder, suffix in (("docs", ".md"), ("contrastive_jax", ".py"), ("configs", ".py")):
    for path, _, names in os.walk(os.path.join(ROOT, folder)):
      for name in names:
        if name.endswith(suffix):
          yield os.path.relpath(os.path.join(path, name), ROOT)
  for path, _, names in os.walk(os.path.join(ROOT, "benchmarks")):
    yield from (os.path.relpath(os.path.join(path, n), ROOT) for n in names if n.endswith(".py"))


def test_no_doc_or_docstring_names_a_tracker_issue():
  found = []
  for rel in _text_files():
    for number, line in enumerate(_read(rel).splitlines(), 1):
      for match in _TRACKER_ISSUE.finditer(line):
        if (match.group(1) or "").strip().lower() not in _OTHER_PROJECTS:
          found.append(f"{rel}:{number}: {match.group(0)}")
  assert not found, found


def test_the_tracker_issue_pattern_tells_ours_from_another_projects():
  def flagged(text):
    return [
      m.group(0)
      for m in _TRACKER_ISSUE.finditer(text)
      if (m.group(1) or "").strip().lower() not in _OTHER_PROJECTS
    ]

  assert flagged("before issue 17 (commit x)") == ["before issue 17"]
  assert flagged("Issue #18 and issues 3") == ["Issue #18", "and issues 3"]
  assert flagged("random data has none (faiss issue #2700)") == []
  assert flagged("an issue with the 3 seeds") == []
