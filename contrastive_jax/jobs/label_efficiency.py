"""The label-efficiency job (config.job='label_efficiency'): what an init buys per label count.

  python -m contrastive_jax.main --config=configs/label_efficiency.py \
      --config.pretrain_workdir=PRETRAIN_DIR --config.labels=100,500,1000 --workdir=DIR

For each init (config.inits: 'pretrained', the checkpoint of pretrain_workdir;
'random', that run's initialisation of the encoder; any other name, the weights
file config.weights gives it, read as the model config.weights_config gives it:
weights_files), label count, seed and protocol (config.protocols) it runs one cell:
training/label_efficiency.draw_subset draws the class-balanced labelled subset
of the count for the seed from train_split, with a validation part held out of
it; the protocol fits on the subset's train part and makes every choice on its
validation part (kNN: k of config.knn.k; linear probe and fine-tuning: the
epoch, of those evaluated every eval_every epochs, of best validation top-1);
then, at the cell's end only, the model so chosen scores test_split: top-1,
balanced accuracy and (config.auroc) AUROC.

Protocols (training/protocols.py, PROTOCOLS): 'knn', the weighted kNN of the
frozen encoder's h; 'linear_probe', a linear head on the frozen h; 'finetune', the
encoder and a linear head trained together (from h or, with
finetune.projector_layers, from that many of its projection head's hidden layers:
SimCLR v2's fine-tuning); 'lp_ft', LP-FT (Kumar et al. 2022): that fine-tuning
from a linear probe's head.

Each finished cell is written as WORKDIR/cells/INIT-PROTOCOL-LABELS-SEED.json;
a job started again on the same workdir skips those cells (its config must equal
config.json's but for runner.MAY_CHANGE_ON_RESUME, the rule of every job). At the end (and
after each cell) it writes curve.csv (a row per cell), summary.json
(training/label_efficiency.summarise: each init's best protocol by validation,
the gain of the first init over the others with a 95% interval paired by
seed) and curve.png (the test score config.curve_metric against labels, log
axis, a line per init and protocol, the seeds' range shaded). Single-process only.
"""

import csv
import io
import json
import math

from absl import logging
import jax
import ml_collections
import numpy as np

from contrastive_jax import config_files
from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import pictures
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.data import crop_spec
from contrastive_jax.data import in_memory
from contrastive_jax.methods import optim
from contrastive_jax.training import downstream
from contrastive_jax.training import label_efficiency as le
from contrastive_jax.training import protocols as protocols_lib
from contrastive_jax.training import restore
from contrastive_jax.training import runner

INITS = ("pretrained", "random")  # The checkpoint's inits; every other init is a weights file's.
PROTOCOLS = tuple(protocols_lib.PROTOCOLS)
CELLS = "cells"
CONFIG_FILE = "config.json"
COLUMNS = ("init", "protocol", "labels", "seed", "top1", "auroc", "balanced_accuracy")
# curve.png's metric: config.curve_metric -> its axis caption.
CURVE_METRICS = {"top1": "top-1", "balanced_accuracy": "balanced accuracy", "auroc": "AUROC"}
# The weights init's fields, as restore.restore_encoder reads them -> as this job names them.
WEIGHTS_FIELDS = {"pretrain_workdir": "weights", "pretrain_config": "weights_config"}


def check_config(config, num_devices: int):
  """Raises ConfigError for a field that cannot run, before any data or checkpoint is read."""
  if jax.process_count() > 1:
    raise ConfigError("job", config.job, "run on one process (a multi-host run is not supported)")
  inits = protocols_lib.listed(config.inits)
  if (
    not inits
    or any(not config_files.is_init_name(i) for i in inits)
    or len(set(inits)) < len(inits)
  ):
    raise ConfigError(
      "inits",
      config.inits,
      f"distinct comma-separated names: {list(INITS)} or the names of weights files in "
      "config.weights (letters, digits, _ and -, a letter first)",
    )
  weights_files(config)
  protocols = protocols_lib.listed(config.protocols)
  if not protocols or any(p not in PROTOCOLS for p in protocols):
    raise ConfigError("protocols", config.protocols, f"comma-separated names of {list(PROTOCOLS)}")
  if config.curve_metric not in CURVE_METRICS or (
    config.curve_metric == "auroc" and not config.auroc
  ):
    raise ConfigError(
      "curve_metric",
      config.curve_metric,
      f"one of {sorted(CURVE_METRICS)} ('auroc' with auroc True)",
    )
  if config.seeds < 1:
    raise ConfigError("seeds", config.seeds, "an integer >= 1")
  if not 0 < config.validation_fraction < 1:
    raise ConfigError("validation_fraction", config.validation_fraction, "in (0, 1)")
  if config.eval_batch_size <= 0 or config.eval_batch_size % num_devices:
    raise ConfigError(
      "eval_batch_size", config.eval_batch_size, f"a positive multiple of {num_devices}"
    )
  ks = protocols_lib.listed(config.knn.k)
  if not ks or any(not k.isdigit() or int(k) < 1 for k in ks):
    raise ConfigError("knn.k", config.knn.k, "comma-separated integers >= 1, e.g. '10,20,50'")
  if not config.knn.temperature > 0:
    raise ConfigError("knn.temperature", config.knn.temperature, "> 0")
  for name in ("linear_probe", "finetune"):
    part = config[name]
    optim.check_optimizer_config(part.optimizer)
    try:
      scales = protocols_lib.grid(part.lr_grid)
    except ValueError:
      scales = []
    if (
      not scales
      or any(not (scale > 0 and math.isfinite(scale)) for scale in scales)
      or len(set(scales)) < len(scales)
    ):
      raise ConfigError(
        f"{name}.lr_grid",
        part.lr_grid,
        "distinct comma-separated numbers > 0, multipliers of optimizer.base_lr (e.g. '0.3,1,3')",
      )
    for field in ("epochs", "eval_every", "batch_size"):
      if part[field] < 1:
        raise ConfigError(f"{name}.{field}", part[field], "an integer >= 1")
  crop_spec.check_config(config.finetune)  # Named as crop.*: the fine-tuning's crop.
  downstream.check_multipliers(config.finetune, "finetune.")
  layers = config.finetune.projector_layers
  if not isinstance(layers, int) or layers < 0:
    raise ConfigError(
      "finetune.projector_layers", layers, "an integer >= 0 (0: fine-tuning from h)"
    )
  if layers and "lp_ft" in protocols:
    raise ConfigError(
      "finetune.projector_layers",
      layers,
      "0 with 'lp_ft' in protocols: LP-FT's probe is fitted on h, not on the head's layers",
    )
  if config.finetune.batch_size % num_devices:
    raise ConfigError(
      "finetune.batch_size", config.finetune.batch_size, f"a multiple of {num_devices}"
    )


def weights_files(config) -> dict:
  """{init: (weights file, its model's configs/X.py[:ARG] or None)} of config.inits' weights
  inits (every init but INITS), in inits order, from config.weights and config.weights_config:
  entries 'NAME=VALUE' separated by ';' (config_files.named_entries; run reads its config
  through config_files.upgrade_config, which turns the older one-file form, a bare value,
  into the init 'weights'). A file without a config entry must be one the export job wrote
  (restore.weights_config reads its run's config beside it).

  Raises:
    ConfigError: an entry that is not 'NAME=VALUE', a name given twice, an entry for a name
      that is not a weights init of inits, a weights init without a file.
  """
  inits = [i for i in protocols_lib.listed(config.inits) if i not in INITS]
  entries = {}
  for field in ("weights", "weights_config"):
    try:
      entries[field] = config_files.named_entries(config.get(field))
    except ValueError as e:
      raise ConfigError(
        field,
        config.get(field),
        f"entries NAME=VALUE separated by ';', each name once ({e}), "
        "e.g. 'dinov2_b=/w/dinov2_vitb14_pretrain.pth;dinov2_l=/w/dinov2_vitl14_pretrain.pth'",
      ) from None
    stray = [name for name in entries[field] if name not in inits]
    if stray:
      raise ConfigError(
        field,
        config.get(field),
        f"entries for weights inits of inits ({', '.join(inits) or 'none'}); {stray[0]!r} "
        "is not one: add it to inits",
      )
  missing = [init for init in inits if init not in entries["weights"]]
  if missing:
    raise ConfigError(
      "weights",
      config.get("weights"),
      f"a weights file for each init of inits but {list(INITS)}: "
      f"none for {missing[0]!r} (give it as {missing[0]}=FILE)",
    )
  return {init: (entries["weights"][init], entries["weights_config"].get(init)) for init in inits}


def run(config, workdir: str) -> dict:
  """Runs every cell not yet finished in workdir, then writes the curve; returns the summary.

  Raises:
    ConfigError: see check_config, le.parse_counts and le.check_counts; an
      unlabeled dataset; AUROC of a test split without some class; a fine-tune
      train part smaller than the device count; an init that cannot be
      restored (restore.restore_encoder), or a weights file of another model
      than the checkpoint's.
    ResumeError: the workdir's cells were computed with another config.
  """
  workdir = files.prepare_workdir(workdir)
  # Read as a saved config is, so that the older one-file form of weights names its init.
  config = config_files.upgrade_config(config)
  check_config(config, jax.device_count())
  source = downstream.labelled_source(config, "the label-efficiency job")
  source.num_examples(config.test_split, "test_split")
  ids, labels = source.ids_and_labels(config.train_split)
  counts = le.parse_counts(config.labels, len(ids))
  le.check_counts(counts, labels, source.num_classes, source.class_names)
  if config.auroc:
    _check_auroc(config, source)
  if {"finetune", "lp_ft"} & set(protocols_lib.listed(config.protocols)):
    _check_finetune_sizes(config, counts, source.num_classes)
  with files.workdir_lock(workdir):
    mesh = mesh_lib.make_mesh()
    config, encoders, tuned = _resume(config, workdir, mesh)
    files.makedirs(f"{workdir}/{CELLS}")
    done = set(files.listdir(f"{workdir}/{CELLS}"))
    cells = {
      init: protocols_lib.Cells(config, mesh, source, encoder, tuned[init])
      for init, encoder in encoders.items()
    }
    for count in counts:
      for seed in range(config.seeds):
        todo = [
          (init, protocol, f"{init}-{protocol}-{count}-{seed}.json")
          for init in encoders
          for protocol in protocols_lib.listed(config.protocols)
        ]
        todo = [cell for cell in todo if cell[2] not in done]
        if not todo:
          continue
        subset = le.draw_subset(
          ids, labels, count, seed, source.num_classes, config.validation_fraction
        )
        parts = tuple(
          in_memory.read_parts(source, config.train_split, subset, ids, labels)
        )  # (train part, validation part), their images read once.
        for init, protocol, name in todo:
          row = dict(init=init, protocol=protocol, labels=count, seed=seed)
          row.update(protocols_lib.PROTOCOLS[protocol](cells[init], parts, seed))
          files.write_atomic(f"{workdir}/{CELLS}/{name}", json.dumps(row, indent=1))
          logging.info("Cell %s: %s.", name[:-5], _scores_line(row))
          write_results(config, workdir)
    return write_results(config, workdir)


def _scores_line(row: dict) -> str:
  shown = ("val_top1", "top1", "balanced_accuracy", "auroc", "choice")
  return ", ".join(
    f"{k} {row[k]:.4f}" if isinstance(row[k], float) else f"{k} {row[k]}" for k in shown if k in row
  )


def _check_finetune_sizes(config, counts, num_classes: int):
  """Raises ConfigError when a train part of the smallest count (any seed: the seed moves the
  remainder, and with it the held-out sizes) is fewer images than devices."""
  size = min(
    int(np.sum(shares - le.validation_sizes(shares, config.validation_fraction)))
    for shares in (le.class_shares(min(counts), num_classes, s) for s in range(config.seeds))
  )
  if size < jax.device_count():
    raise ConfigError(
      "labels",
      config.labels,
      f"counts whose train part ({size} images for {min(counts)} labels) fills a fine-tuning "
      f"batch of at least one image per device ({jax.device_count()} devices)",
    )


def _check_auroc(config, source):
  """Raises ConfigError when AUROC is undefined: a class with no example in test_split.

  Reads the test split's labels only (no image): every class of a subset's
  validation part is there by construction (le.draw_subset).
  """
  test_labels = source.ids_and_labels(config.test_split)[1]
  held = np.bincount(test_labels, minlength=source.num_classes)
  if source.num_classes < 2 or not held.all():
    absent = int(np.argmin(held))
    raise ConfigError(
      "auroc",
      config.auroc,
      f"False, or a test_split with every class (one-vs-rest AUROC needs each class and "
      f"another): class {absent} has {held[absent]} of the {len(test_labels)} images of "
      f"{config.test_split!r}",
    )


def _resume(config, workdir: str, mesh):
  """(config with pretrain_step resolved, then _restore_inits' two dicts); writes or checks
  config.json.

  A fresh job saves its config with the checkpoint step it restored; a job
  started again on the workdir restores that step (when pretrain_step is -1,
  the latest) and must compute what its cells computed: config.json, read as
  config_files.upgrade_config reads every saved config, is compared as the runner
  compares a checkpoint's (runner.check_resume).

  Raises:
    ConfigError: see _restore_inits.
    ResumeError: a field outside runner.MAY_CHANGE_ON_RESUME differs from config.json's.
  """
  path, saved = f"{workdir}/{CONFIG_FILE}", None
  config = config.copy_and_resolve_references()
  if files.exists(path):
    with files.open_file(path) as f:
      saved = config_files.upgrade_config(ml_collections.ConfigDict(json.load(f))).to_dict()
    if config.pretrain_step < 0:
      config.pretrain_step = saved.get("pretrain_step", -1)
  encoders, tuned = _restore_inits(config, mesh)
  config.pretrain_step = next((e.step for i, e in encoders.items() if i in INITS), -1)
  if saved is None:
    files.write_atomic(path, json.dumps(config.to_dict(), indent=1, sort_keys=True))
    return config, encoders, tuned
  runner.check_resume(saved, config, workdir)
  return config, encoders, tuned


def _restore_inits(config, mesh):
  """({init: restore.Encoder} in config.inits order, {init: the encoder fine-tuning trains}:
  the same, or with finetune.projector_layers of its projection head after it).

  Each weights file is read as the model its config gives (weights_files), whatever the
  checkpoint's: a foundation model's ViT beside this run's ResNet is the comparison asked.

  Raises:
    ConfigError: see restore.restore_encoder and restore.with_head_layers, a weights init's
      named as this job's fields (weights, weights_config) with the init's entry.
  """
  encoders, tuned = {}, {}
  files_of = weights_files(config)
  for init in protocols_lib.listed(config.inits):
    view = config.copy_and_resolve_references()
    with view.unlocked():
      view.random_init = init == "random"
      if init in files_of:
        view.pretrain_workdir, view.pretrain_config = files_of[init]
    try:
      encoders[init] = restore.restore_encoder(view, mesh)
    except ConfigError as e:  # Named as this job's config names the weights init's fields.
      field = WEIGHTS_FIELDS.get(e.field) if init in files_of else None
      if field is None:
        raise
      raise ConfigError(field, view[e.field], f"{e.allowed} (init {init!r})") from None
    tuned[init] = restore.with_head_layers(
      view, encoders[init], config.finetune.projector_layers, "finetune.projector_layers", mesh
    )
  return encoders, tuned


def read_rows(workdir: str) -> list:
  """The rows of every finished cell in WORKDIR/cells, sorted by (init, protocol, labels, seed)."""
  rows = []
  for name in sorted(files.listdir(f"{workdir}/{CELLS}")):
    if name.endswith(".json"):
      with files.open_file(f"{workdir}/{CELLS}/{name}") as f:
        rows.append(json.load(f))
  return sorted(rows, key=lambda r: (r["init"], r["protocol"], r["labels"], r["seed"]))


def curve_csv(rows: list) -> str:
  """curve.csv's text: COLUMNS, then val_top1 and choice, a row per cell (auroc empty if off)."""
  text = io.StringIO()
  writer = csv.writer(text, lineterminator="\n")
  header = COLUMNS + ("val_top1", "choice")
  writer.writerow(header)
  for row in rows:
    writer.writerow([row.get(c, "") for c in header])
  return text.getvalue()


def write_results(config, workdir: str) -> dict:
  """Writes curve.csv, summary.json and curve.png from the finished cells; returns the summary."""
  rows = read_rows(workdir)
  metrics = ["top1", "balanced_accuracy"] + (["auroc"] if config.auroc else [])
  summary = le.summarise(rows, protocols_lib.listed(config.inits), metrics)
  files.write_atomic(f"{workdir}/curve.csv", curve_csv(rows))
  files.write_atomic(f"{workdir}/summary.json", json.dumps(summary, indent=1))
  lines = {}
  for row in rows:
    lines.setdefault(f"{row['init']} {row['protocol']}", {}).setdefault(row["labels"], []).append(
      row[config.curve_metric]
    )
  pictures.write_png(
    f"{workdir}/curve.png",
    pictures.line_chart(
      lines, x_label="labels (log scale)", y_label=f"test {CURVE_METRICS[config.curve_metric]}"
    ),
  )
  return summary
