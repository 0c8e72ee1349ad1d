"""The entry point's flag parsing: a bad --config file, argument or field ends in one line;
config arguments (config_files.parse_args) combine."""

import glob
import importlib.util
import logging
import os
import subprocess
import sys
import threading
from unittest import mock

from absl import flags
from helpers import CONFIG_DIR
from helpers import subprocess_env
import ml_collections
import pytest

from contrastive_jax import main
from contrastive_jax.core import checkpointing
from contrastive_jax.core import metrics
from contrastive_jax.core.errors import JobError
from contrastive_jax.core.errors import VariantError

SIMCLR = os.path.join(CONFIG_DIR, "simclr_cifar10.py")
MOCOV3 = os.path.join(CONFIG_DIR, "mocov3_cifar10.py")
CONFIG_FILES = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.py")))
# The config fields that count things (or are pixels, seeds, steps, the saved format's
# version, DINO's teacher-temperature warm-up, whole epochs as main_dino.py's int
# --warmup_teacher_temp_epochs): the only int fields.
INTEGER_FIELDS = {
  "batch_size",
  "bn_group_size",
  "bottleneck_dim",
  "cell",
  "chunk_size",
  "clusters",
  "data_threads",
  "depth",
  "direct_num_workers",
  "ef_construction",
  "ef_search",
  "epochs",
  "eval_batch_size",
  "eval_every",
  "format_version",
  "hidden_dim",
  "hidden_dims",
  "hnsw_m",
  "image_size",
  "k",
  "k_factor",
  "keep_checkpoints",
  "label_seed",
  "max_pixels",
  "max_points",
  "n_neighbors",
  "nlist",
  "nprobe",
  "num_heads",
  "num_layers",
  "num_workers",
  "number",
  "out_dim",
  "patch_size",
  "pca",
  "pca_dims",
  "picture_pairs",
  "position_grid",
  "pq_m",
  "pretrain_step",
  "projector_layers",
  "queue_size",
  "registers",
  "seed",
  "seeds",
  "shard_rows",
  "shuffle_buffer",
  "size",
  "teacher_blocks",
  "teacher_step",
  "threads",
  "thumbnail",
  "warmup_teacher_temp_epochs",
}


def _int_fields(config, prefix=""):
  """Dotted names of config's fields typed int or holding a tuple of ints (placeholders too)."""
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _int_fields(value, f"{prefix}{key}.")
    elif config.get_type(key) is int or (
      isinstance(value, tuple) and value and all(type(v) is int for v in value)
    ):
      yield prefix + key


def _module(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize(
  "args, line",
  [
    (
      [f"--config={SIMCLR}", "--config.batchsize=64"],
      f"error: --config.batchsize=64: no field 'batchsize' in --config={SIMCLR}; "
      "did you mean 'batch_size'?",
    ),
    (
      [f"--config={SIMCLR}:runlocl"],
      f"error: --config={SIMCLR}:runlocl: no argument or variant 'runlocl' (the config's "
      "arguments: runlocal, dtype=float32|bfloat16); did you mean 'runlocal'?",
    ),
    (
      [f"--config={MOCOV3}:runlocal,model=vit_tin"],
      f"error: --config={MOCOV3}:runlocal,model=vit_tin: no value 'vit_tin' of argument "
      "'model' (its values: resnet18, vit_tiny); did you mean 'vit_tiny'?",
    ),
    (
      [f"--config={CONFIG_DIR}/simclr_cifar.py"],
      f"error: --config={CONFIG_DIR}/simclr_cifar.py: no such file; did you mean "
      f"'{CONFIG_DIR}/simclr_cifar10.py'?",
    ),
    (
      [f"--config={CONFIG_DIR}/xyzzy.py"],
      f"error: --config={CONFIG_DIR}/xyzzy.py: no such file (the config files in {CONFIG_DIR}: "
      + ", ".join(os.path.basename(f) for f in CONFIG_FILES)
      + ")",
    ),
  ],
)
def test_bad_config_flags_end_in_one_line(tmp_path, args, line):
  """main.py's flags parser (app.run's) ends the process with the line: called here, as a
  process costs a JAX start each; the process test below runs absl's own parse error."""
  # Refused by check_config_flags, before absl's parse (which another test of this worker
  # may already have run, so FLAGS.is_parsed() cannot tell).
  absl_parse = mock.patch.object(
    flags.FlagValues, "__call__", side_effect=AssertionError("absl parsed the flags")
  )
  with absl_parse, pytest.raises(SystemExit) as exit_:
    main.parse_flags(["main", *args, f"--workdir={tmp_path / 'run'}"])
  assert exit_.value.code == line
  assert not os.path.exists(tmp_path / "run")


def test_a_bad_config_flag_ends_the_process_in_its_one_line(tmp_path):
  out = subprocess.run(
    [sys.executable, "-m", "contrastive_jax.main", f"--config={SIMCLR}"]
    + ["--config.batch_size=abc", f"--workdir={tmp_path / 'run'}"],
    capture_output=True,
    text=True,
    timeout=300,
    env=subprocess_env(),
  )
  assert out.returncode == 1, out.stderr
  assert out.stderr.strip().splitlines()[-1] == (
    "error: flag --config.batch_size=abc: invalid literal for int() with base 10: 'abc'"
  )
  assert "Traceback" not in out.stderr and not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize(
  "override, message",
  [
    # The guess is looked for under the deepest group the name reaches, at any depth.
    ("--config.optimizer.warmup_epoch=1", "did you mean 'optimizer.warmup_epochs'?"),
    ("--config.warmup_epochs=1", "did you mean 'optimizer.warmup_epochs'?"),
    ("--config.optimiser.warmup_epochs=1", "did you mean 'optimizer.warmup_epochs'?"),
    ("--config.evaluators.knn.kk=1", "did you mean 'evaluators.knn.k'?"),
    ("--config.batch_size.x=1", "did you mean 'batch_size'?"),
    # Nothing close: the group's fields are listed.
    (
      "--config.optimizer.xyzzy=1",
      "no field 'optimizer.xyzzy' in --config=.* \\(the fields of "
      "config.optimizer: base_lr, decay_epochs, .*, weight_decay_mask\\)$",
    ),
    (
      "--noconfig.xyzzy",
      "^--noconfig.xyzzy: no field 'xyzzy' .*\\(the fields of config: augment, ",
    ),
  ],
)
def test_misspelled_field_names_its_closest(override, message):
  with pytest.raises(JobError, match=message):
    main.check_config_flags(["main", f"--config={SIMCLR}", override])


def test_valid_flags_pass_the_check():
  for argv in (
    [
      "main",
      "--config",
      SIMCLR,
      "--config.evaluators.knn.k=3",
      "--noconfig.cache",
      "--config.evaluators={}",
      "--config.evaluators.knn",
      "3",
    ],
    ["main", f"--config={MOCOV3}:runlocal_vit", "--config.model.depth=2"],
    [
      "main",
      f"--config={MOCOV3}:model=vit_tiny,runlocal,dtype=bfloat16",
      "--config.model.patch_size=4",
    ],
    ["main", "--workdir=x"],
  ):  # No --config: absl says it is required.
    main.check_config_flags(argv)


def _arguments(module):
  """Every arg string worth loading of a config module: '', each variant, each value of
  each argument."""
  yield ""
  yield from getattr(module, "VARIANTS", {})
  for key, spec in module.ARGS.items():
    yield from ([key] if spec is False else [f"{key}={value}" for value in spec])


def test_every_config_declares_its_arguments_and_refuses_others():
  for path in CONFIG_FILES:
    module = _module(path)
    for arg in _arguments(module):
      assert module.get_config(arg).job, (path, arg)
    with pytest.raises(VariantError) as error:
      module.get_config("runlocl")
    assert error.value.given == "runlocl"
  with pytest.raises(
    JobError,
    match=r"embed.py:runlocal: no argument or variant 'runlocal' "
    r"\(the config takes none\)$",
  ):
    main.check_config_flags(["main", f"--config={CONFIG_DIR}/embed.py:runlocal"])


@pytest.mark.parametrize(
  "arg, message",
  [
    (
      "runlocal,modle=vit_tiny",
      r"^no argument 'modle' \(the config's arguments: runlocal, "
      r"model=resnet18\|vit_tiny, dtype=float32\|bfloat16; variants: runlocal_vit "
      r"\(runlocal,model=vit_tiny\)\); did you mean 'model'\?$",
    ),
    ("vit_tiny", r"^no argument or variant 'vit_tiny' .*; did you mean 'model=vit_tiny'\?$"),
    (
      "model",
      r"^argument 'model' needs a value, one of resnet18, vit_tiny "
      r"\(e.g. model=resnet18\)$",
    ),
    ("runlocal=yes", r"^no value 'yes' of argument 'runlocal' \(its values: False, True\)$"),
    ("dtype=bfloat61", r"did you mean 'bfloat16'\?$"),
  ],
)
def test_a_bad_argument_names_what_the_config_takes(arg, message):
  with pytest.raises(VariantError, match=message):
    _module(MOCOV3).get_config(arg)


def test_arguments_combine_left_to_right_and_variants_stand_for_their_items():
  mocov3, simclr = _module(MOCOV3), _module(SIMCLR)
  vit = mocov3.get_config("runlocal_vit").to_dict()
  assert mocov3.get_config("model=vit_tiny,runlocal").to_dict() == vit
  assert mocov3.get_config(" runlocal , model=vit_tiny ,").to_dict() == vit
  assert mocov3.get_config("runlocal_vit,model=resnet18").to_dict() == (
    mocov3.get_config("runlocal").to_dict()
  )
  assert simclr.get_config("runlocal=True").to_dict() == simclr.get_config("runlocal").to_dict()
  assert simclr.get_config("runlocal,runlocal=False").to_dict() == simclr.get_config().to_dict()


def _leaves(tree, prefix=""):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield prefix + key, value


@pytest.mark.parametrize(
  "name", ["simclr_cifar10", "moco_v2_cifar10", "byol_cifar10", "mocov3_cifar10"]
)
def test_dtype_combines_with_runlocal_and_changes_only_the_dtype(name):
  module = _module(os.path.join(CONFIG_DIR, f"{name}.py"))
  models = ("resnet18", "vit_tiny") if "model" in module.ARGS else (None,)
  for model in models:
    arg = "runlocal" + (f",model={model}" if model else "")
    float32 = dict(_leaves(module.get_config(arg).to_dict()))
    bfloat16 = dict(_leaves(module.get_config(arg + ",dtype=bfloat16").to_dict()))
    assert float32["model.dtype"] == "float32" and bfloat16["model.dtype"] == "bfloat16"
    assert {k for k in float32 if float32[k] != bfloat16.get(k)} == {"model.dtype"}
    assert float32.keys() == bfloat16.keys()


def test_only_counts_are_integer_fields_so_fractions_parse():
  # Epochs, rates, fractions, probabilities, widths: floats, so that an override such as
  # --config.optimizer.warmup_epochs=0.5 parses (a ConfigDict field keeps its first type).
  for path in CONFIG_FILES:
    module = _module(path)
    for arg in _arguments(module):
      config = module.get_config(arg)
      assert [f for f in _int_fields(config) if f.split(".")[-1] not in INTEGER_FIELDS] == [], (
        path,
        arg,
      )
      if "optimizer" in config:
        assert config.optimizer.get_type("warmup_epochs") is float
        assert all(isinstance(e, float) for e in config.optimizer.decay_epochs or ())


def test_a_file_that_is_not_a_config_is_named(tmp_path):
  (tmp_path / "notes.py").write_text("x = 1\n")
  (tmp_path / "notes.md").write_text("# Not Python at all\nSee the README.\n")
  with pytest.raises(JobError, match=r"notes.py: not a config file: it defines no get_config"):
    main.check_config_flags(["main", f"--config={tmp_path}/notes.py"])
  with pytest.raises(
    JobError,
    match=r"notes.md: not a config file: Python cannot read it "
    r"\(invalid syntax, line 2\)",
  ):
    main.check_config_flags(["main", f"--config={tmp_path}/notes.md"])


def test_a_checkpointer_leaves_no_orbax_thread_running_once_created(tmp_path):
  # Orbax removes a writer's stale temporary folders in a thread; one still running when a
  # job fails at once (before its first save) printed an error line after the job's own.
  (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1").mkdir(parents=True)
  ckpt = checkpointing.Checkpointer(str(tmp_path / "checkpoints"))
  assert not [t for t in threading.enumerate() if "orbax" in type(t).__module__]
  assert os.listdir(tmp_path / "checkpoints") == []
  ckpt.close()


def test_a_text_file_as_init_from_ends_the_process_in_its_one_line(tmp_path):
  # One run, not several: a second line from Orbax's removal thread, still running at the
  # interpreter's shutdown, would come in some runs only; that the thread has ended before the
  # job goes on is checked without timing by
  # test_a_checkpointer_leaves_no_orbax_thread_running_once_created.
  weights = tmp_path / "x.safetensors"
  weights.write_text("hello, not weights\n")
  workdir = tmp_path / "run"
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "contrastive_jax.main",
      f"--config={SIMCLR}:runlocal",
      f"--workdir={workdir}",
      f"--config.init_from={weights}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=subprocess_env(),
  )
  assert out.returncode == 1, out.stderr
  lines = out.stderr.strip().splitlines()
  assert lines[-1] == (
    f"error: {weights}: not a safetensors file (a header length of "
    "7935391400498849128 bytes in a file of 19)"
  ), out.stderr
  assert not [line for line in lines if line.startswith(("E", "W", "Traceback"))], out.stderr
  assert not os.path.exists(workdir)  # The workdir it made is gone again.


def test_the_log_filter_drops_restated_settings_and_keeps_real_warnings():
  keep = metrics._QuietLibraries().filter  # pylint: disable=protected-access

  def record(path, level, message):
    return logging.LogRecord("absl", level, path, 1, message, None, None)

  jax_path, orbax_path = "/site/jax/_src/xla_bridge.py", "/site/orbax/checkpoint/manager.py"
  assert not keep(
    record(
      jax_path,
      logging.INFO,
      "Unable to initialize backend 'tpu': INTERNAL: "
      "Failed to open libtpu.so: libtpu.so: cannot open shared object file",
    )
  )
  assert keep(record(jax_path, logging.INFO, "Unable to initialize backend 'cuda': no GPU"))
  assert keep(record(jax_path, logging.WARNING, "An NVIDIA GPU may be present"))
  assert not keep(record(orbax_path, logging.WARNING, "Given directory is read only=/x"))
  assert keep(record(orbax_path, logging.WARNING, "Checkpoint step 3 could not be read"))
  assert keep(record(orbax_path, logging.ERROR, "Given directory is read only: failed"))
  assert not keep(record(orbax_path, logging.INFO, "Saving item state"))
  tfds_path = "/site/tensorflow_datasets/core/features/feature.py"
  deprecated = "`Image.dtype` is deprecated. Please change your code to use NumPy with the field"
  assert not keep(record(tfds_path, logging.WARNING, deprecated))
  assert keep(record(tfds_path, logging.WARNING, "Found a different version of the dataset"))
  saved_model_path = "/site/tensorflow/python/saved_model/signature_serialization.py"
  renamed = "Function `serve` contains input name(s) resource with unsupported characters"
  assert not keep(record(saved_model_path, logging.WARNING, renamed))
  assert not keep(record(saved_model_path, logging.INFO, "Writing fingerprint to /x"))
  assert keep(record(saved_model_path, logging.WARNING, "Found untraced functions"))


def test_the_last_line_names_what_the_job_wrote_since_it_started(tmp_path):
  old = 1_000_000_000.0  # 2001: long before the job.
  for rel in ("old.txt", "kept/old.txt", "grown/old.txt", "grown/deep/new.txt", "new.txt", ".lock"):
    os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
    (tmp_path / rel).write_text(rel)
  for rel in ("old.txt", "kept/old.txt", "kept", "grown/old.txt"):
    os.utime(tmp_path / rel, (old, old))
  line = main._finished_line("embed", str(tmp_path), old + 10)
  assert line.startswith("Finished embed in ") and line.endswith(
    f" s: wrote grown/, new.txt to {tmp_path}."
  )
  assert main._finished_line("embed", str(tmp_path / "none"), old + 10).endswith(
    f" s: wrote nothing new in {tmp_path / 'none'}."
  )
  for i in range(12):
    (tmp_path / f"file{i:02}").write_text("")
  listed = ", ".join(f"file{i:02}" for i in range(12))
  assert main._finished_line("embed", str(tmp_path), old + 10).endswith(
    f"wrote {listed} and 2 more to {tmp_path}."
  )
