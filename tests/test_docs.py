"""The docs name what the code has: every job of main.JOBS has a command in the README's jobs
table and a line in docs/jobs.md, and every config file the README or docs/jobs.md names exists."""

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
