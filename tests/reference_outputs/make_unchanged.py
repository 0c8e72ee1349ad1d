"""Re-records tests/reference_outputs/unchanged.json, what tests/test_unchanged.py compares with.

  python tests/reference_outputs/make_unchanged.py

runs that test file under pytest (so under tests/conftest.py's devices and XLA
options, as the suite runs it) with UNCHANGED_RECORD=1: its fixture runs the
jobs and writes what they logged to the record before the tests compare with
it. Run it from the checkout whose values are to be kept (the package is
imported from the checkout, not from an installed copy); TFDS_DATA_DIR names
the CIFAR-10 the tests read (tests/helpers.py). Only a change meant to change
results should re-record, its commit saying which values moved and why.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  env = dict(
    os.environ,
    UNCHANGED_RECORD="1",
    PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
  )
  command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
  command.append(os.path.join(ROOT, "tests", "test_unchanged.py"))
  sys.exit(subprocess.run(command, cwd=ROOT, env=env, check=False).returncode)


if __name__ == "__main__":
  main()
