"""The TF-free set (docs/design.md, 'Without TensorFlow') without TensorFlow:
tests/without_tensorflow_worker.py in a subprocess where `import tensorflow` and
`import tensorflow_datasets` fail, as on an accelerator image with JAX alone, imports every
module of the set and trains; and it does fail when a module of the set imports TensorFlow."""

import json
import os
import shutil
import subprocess
import sys

from helpers import TESTS
from helpers import subprocess_env
from without_tensorflow_worker import tf_free_modules

WORKER = os.path.join(TESTS, "without_tensorflow_worker.py")
ROOT = os.path.dirname(TESTS)


def _run(*methods, pythonpath=ROOT):
  env = subprocess_env()
  env["PYTHONPATH"] = os.pathsep.join([TESTS, pythonpath])
  return subprocess.run(
    [sys.executable, WORKER, *methods], env=env, capture_output=True, text=True, timeout=900
  )


def test_train_steps_checkpoints_and_metrics_run_without_tensorflow():
  done = _run("simclr", "moco_v2", "byol")
  assert done.returncode == 0, done.stderr[-4000:]
  result = json.loads(done.stdout.split("RESULT ", 1)[1])
  # The TF-free set of docs/design.md, every module imported with TensorFlow blocked.
  assert result["modules"] == tf_free_modules(os.path.join(ROOT, "contrastive_jax"))
  assert "contrastive_jax.training.runner" in result["modules"]
  assert "contrastive_jax.data.device_samplers" in result["modules"]
  assert sorted(result["methods"]) == ["byol", "moco_v2", "simclr"]
  for name, method in result["methods"].items():
    assert len(method["losses"]) == 2 and method["leaves"] > 0, name
    assert method["events"] == [], name  # No TensorBoard events without TensorFlow, which
  # the process says once (three writers here), naming where the scalars are.
  assert done.stderr.count("TensorBoard events are not written: they need TensorFlow") == 1
  assert "simclr/metrics.jsonl" in done.stderr


def test_a_train_path_module_importing_tensorflow_fails_the_worker(tmp_path):
  shutil.copytree(os.path.join(ROOT, "contrastive_jax"), tmp_path / "contrastive_jax")
  path = tmp_path / "contrastive_jax" / "core" / "checkpointing.py"
  source = path.read_text()
  path.write_text(source.replace("import json\n", "import json\nimport tensorflow\n", 1))
  done = _run("simclr", pythonpath=str(tmp_path))
  assert done.returncode != 0
  assert "No module named 'tensorflow'" in done.stderr or "import of tensorflow halted" in (
    done.stderr
  ), done.stderr[-2000:]
  assert "checkpointing.py" in done.stderr
  assert "RESULT" not in done.stdout
