"""The label-efficiency job (config.job='label_efficiency'): what an init buys per label count.

  python -m contrastive_jax.main --config=configs/label_efficiency.py \
      --config.pretrain_workdir=PRETRAIN_DIR --config.labels=100,500,1000 --workdir=DIR

For each init (config.inits: 'pretrained', the checkpoint of pretrain_workdir;
'random', that run's initialisation of the encoder; 'weights', the weights file
config.weights read as the model of config.weights_config), label count, seed
and protocol (config.protocols) it runs one cell:
training/label_efficiency.draw_subset draws the class-balanced labelled subset
of the count for the seed from train_split, with a validation part held out of
it; the protocol fits on the subset's train part and makes every choice on its
validation part (kNN: k of config.knn.k; linear probe and fine-tuning: the
epoch, of those evaluated every eval_every epochs, of best validation top-1);
then, at the cell's end only, the model so chosen scores test_split: top-1,
balanced accuracy and (config.auroc) AUROC.

Protocols: 'knn', the weighted kNN of the frozen encoder's h (evaluators.knn_scores;
bank: the train part); 'linear_probe', downstream.LinearHead trained on the
frozen encoder's h of the train part's images, centre-cropped as for evaluation
(no augmentation: the features are computed once per cell); 'finetune', the
encoder and a zero-initialised linear head trained together on random crops
(downstream.make_finetune_step, BN in train mode), from h or, with
finetune.projector_layers, from that many of its projection head's hidden layers (SimCLR
v2's fine-tuning); 'lp_ft', LP-FT (Kumar et al. 2022):
that fine-tuning with the head of a linear probe (not standardised) of the frozen h.

Each finished cell is written as WORKDIR/cells/INIT-PROTOCOL-LABELS-SEED.json;
a job started again on the same workdir skips those cells. At the end (and
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
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tensorflow as tf

from contrastive_jax import models
from contrastive_jax.core import checkpointing
from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import pictures
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import ResumeError
from contrastive_jax.data import crop_spec
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import labelled
from contrastive_jax.methods import ENCODER
from contrastive_jax.methods import common
from contrastive_jax.methods import encoder_variables
from contrastive_jax.methods import optim
from contrastive_jax.training import downstream
from contrastive_jax.training import evaluators
from contrastive_jax.training import label_efficiency as le
from contrastive_jax.training import restore

INITS = ("pretrained", "random", "weights")
PROTOCOLS = ("knn", "linear_probe", "finetune", "lp_ft")
CELLS = "cells"
CONFIG_FILE = "config.json"
COLUMNS = ("init", "protocol", "labels", "seed", "top1", "auroc", "balanced_accuracy")
# curve.png's metric: config.curve_metric -> its axis caption.
CURVE_METRICS = {"top1": "top-1", "balanced_accuracy": "balanced accuracy", "auroc": "AUROC"}
# Fields a resumed job may change: how fast it reads and evaluates, never what a cell computes.
MAY_CHANGE_ON_RESUME = ("data_dir", "data_threads", "cache", "eval_batch_size")


def _listed(value) -> list:
  return [v.strip() for v in str(value).split(",") if v.strip()]


def check_config(config, num_devices: int):
  """Raises ConfigError for a field that cannot run, before any data or checkpoint is read."""
  if jax.process_count() > 1:
    raise ConfigError("job", config.job, "run on one process (a multi-host run is not supported)")
  inits = _listed(config.inits)
  if not inits or any(i not in INITS for i in inits) or len(set(inits)) < len(inits):
    raise ConfigError("inits", config.inits, f"distinct comma-separated names of {list(INITS)}")
  if "weights" in inits and not config.weights:
    raise ConfigError("weights", config.weights, "a weights file, with 'weights' in inits")
  protocols = _listed(config.protocols)
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
  ks = _listed(config.knn.k)
  if not ks or any(not k.isdigit() or int(k) < 1 for k in ks):
    raise ConfigError("knn.k", config.knn.k, "comma-separated integers >= 1, e.g. '10,20,50'")
  if not config.knn.temperature > 0:
    raise ConfigError("knn.temperature", config.knn.temperature, "> 0")
  for name in ("linear_probe", "finetune"):
    part = config[name]
    optim.check_optimizer_config(part.optimizer)
    try:
      scales = _grid(part.lr_grid)
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
  check_config(config, jax.device_count())
  source = downstream.labelled_source(config, "the label-efficiency job")
  source.num_examples(config.test_split, "test_split")
  ids, labels = source.ids_and_labels(config.train_split)
  counts = le.parse_counts(config.labels, len(ids))
  le.check_counts(counts, labels, source.num_classes, source.class_names)
  if config.auroc:
    _check_auroc(config, source)
  if {"finetune", "lp_ft"} & set(_listed(config.protocols)):
    _check_finetune_sizes(config, counts, source.num_classes)
  with files.workdir_lock(workdir):
    mesh = mesh_lib.make_mesh()
    config, encoders, tuned = _resume(config, workdir, mesh)
    files.makedirs(f"{workdir}/{CELLS}")
    done = set(files.listdir(f"{workdir}/{CELLS}"))
    cells = {
      init: _Cells(config, mesh, source, encoder, tuned[init]) for init, encoder in encoders.items()
    }
    for count in counts:
      for seed in range(config.seeds):
        todo = [
          (init, protocol, f"{init}-{protocol}-{count}-{seed}.json")
          for init in encoders
          for protocol in _listed(config.protocols)
        ]
        todo = [cell for cell in todo if cell[2] not in done]
        if not todo:
          continue
        subset = le.draw_subset(
          ids, labels, count, seed, source.num_classes, config.validation_fraction
        )
        parts = _read_parts(source, config.train_split, subset, ids, labels)
        for init, protocol, name in todo:
          row = dict(init=init, protocol=protocol, labels=count, seed=seed)
          row.update(cells[init].run(protocol, parts, seed))
          files.write_atomic(f"{workdir}/{CELLS}/{name}", json.dumps(row, indent=1))
          logging.info("Cell %s: %s.", name[:-5], _scores_line(row))
          write_results(config, workdir)
    return write_results(config, workdir)


class _InMemory:
  """Decoded images and their labels held in host memory: a source (sources.Source) whose
  every split is them, read by one process. Serves a subset's part to the protocols, which
  read it many times (each evaluation, each fine-tuning epoch)."""

  random_access = False

  def __init__(self, source, images: list, labels: np.ndarray):
    self.name, self.num_classes = source.name, source.num_classes
    self.class_names = source.class_names
    self._images, self._labels = images, labels

  def num_examples(self, split: str, field: str) -> int:
    """Source.num_examples: how many images it holds."""
    del split, field
    return len(self._labels)

  def process_counts(self, split: str, drop_remainder: bool = False) -> list:
    """Source.process_counts: one process reads them all."""
    del split, drop_remainder
    return [len(self._labels)]

  def read(
    self, split: str, *, drop_remainder: bool, decode: bool = True, names: bool = False
  ) -> tf.data.Dataset:
    """Source.read: (image, label) in order; decoded only (ValueError otherwise), no names."""
    del split, drop_remainder
    if not decode or names:
      raise ValueError("an in-memory part serves decoded images without names only")
    return tf.data.Dataset.from_generator(
      lambda: zip(self._images, self._labels),
      output_signature=(
        tf.TensorSpec([None, None, 3], tf.uint8),
        tf.TensorSpec([], tf.int32),
      ),
    )


def _read_parts(source, split: str, subset: le.Subset, ids, labels):
  """(train part, validation part) of subset as _InMemory sources: the images read once."""
  both = np.concatenate([subset.train, subset.validation])
  order = np.argsort(both)
  reader = labelled.LabelledSubset.of_indices(source, split, both[order], ids, labels)
  images = [None] * len(both)
  for position, (image, _) in zip(
    order, reader.read(split, drop_remainder=False).as_numpy_iterator()
  ):
    images[position] = image
  n = len(subset.train)
  return (
    _InMemory(source, images[:n], labels[subset.train]),
    _InMemory(source, images[n:], labels[subset.validation]),
  )


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
  the latest) and must compute what its cells computed.

  Raises:
    ConfigError: see _restore_inits.
    ResumeError: a field outside MAY_CHANGE_ON_RESUME differs from config.json's.
  """
  path, saved = f"{workdir}/{CONFIG_FILE}", None
  config = config.copy_and_resolve_references()
  if files.exists(path):
    with files.open_file(path) as f:
      saved = json.load(f)
    if config.pretrain_step < 0:
      config.pretrain_step = saved.get("pretrain_step", -1)
  encoders, tuned = _restore_inits(config, mesh)
  config.pretrain_step = next((e.step for i, e in encoders.items() if i != "weights"), -1)
  if saved is None:
    files.write_atomic(path, json.dumps(config.to_dict(), indent=1, sort_keys=True))
    return config, encoders, tuned
  for part in ("linear_probe", "finetune"):  # Saved before lr_grid: the base rate alone.
    saved.get(part, {}).setdefault("lr_grid", "1")
  saved.get("finetune", {}).setdefault("projector_layers", 0)  # Saved before it: from h.
  differences = checkpointing.config_differences(saved, config, MAY_CHANGE_ON_RESUME)
  if differences:
    raise ResumeError(workdir, differences, MAY_CHANGE_ON_RESUME)
  return config, encoders, tuned


def _restore_inits(config, mesh):
  """({init: restore.Encoder} in config.inits order, {init: the encoder fine-tuning trains}:
  the same, or with finetune.projector_layers of its projection head after it).

  Raises:
    ConfigError: see restore.restore_encoder and restore.with_head_layers; a weights file
      whose model is not the checkpoint's (when 'pretrained' or 'random' is also an init).
  """
  encoders, tuned = {}, {}
  for init in _listed(config.inits):
    view = config.copy_and_resolve_references()
    with view.unlocked():
      view.random_init = init == "random"
      if init == "weights":
        view.pretrain_workdir, view.pretrain_config = config.weights, config.weights_config
    encoders[init] = restore.restore_encoder(view, mesh)
    tuned[init] = restore.with_head_layers(
      view, encoders[init], config.finetune.projector_layers, "finetune.projector_layers", mesh
    )
  names = {init: e.pretrained.model.name for init, e in encoders.items()}
  if "weights" in names and len(set(names.values())) > 1:
    checkpoint = names.get("pretrained", names.get("random"))
    raise ConfigError(
      "weights",
      config.weights,
      f"a weights file of the checkpoint's model {checkpoint!r}, not {names['weights']!r}",
    )
  return encoders, tuned


class _Cells:
  """The cells of one init: its subsets, their features, the protocols. encoder: what kNN and
  the probes read; tuned: what fine-tuning trains (_restore_inits)."""

  def __init__(self, config, mesh, source, encoder: restore.Encoder, tuned: restore.Encoder):
    self._config, self._mesh, self._source, self._encoder = config, mesh, source, encoder
    self._tuned = tuned
    self._eval_crop = input_pipeline.EvalCrop.of(encoder.pretrained)
    self._features = jax.jit(lambda v, x: models.encode(encoder.module, v, x))
    self._test_features = None  # h of test_split, computed at the end of the first cell.
    # The fine-tuning head: a zero-initialised linear layer on h.
    self._head = nn.Dense(source.num_classes, kernel_init=nn.initializers.zeros)
    self._programs = {}  # The probe's and fine-tuning's jitted programs, by their shapes.
    self._frozen = (None, None)  # (parts, their frozen h): the last parts' (_frozen_parts).

  def run(self, protocol: str, parts, seed: int) -> dict:
    """The scores of `protocol` fitted on parts = (train, validation) (_read_parts) for seed."""
    return getattr(self, f"_{protocol}")(parts, seed)

  def _outputs(self, fn, variables, source, split: str):
    """(fn(variables, images) of every image of split, as numpy [N, ...], labels int [N])."""
    ds = input_pipeline.eval_dataset(
      source,
      split,
      local_batch=self._config.eval_batch_size,
      eval_crop=self._eval_crop,
      threads=self._config.data_threads,
    )
    outputs, labels = [], []
    for batch in mesh_lib.device_batches(
      ds.as_numpy_iterator(), mesh_lib.batch_sharded(self._mesh)
    ):
      mask = np.asarray(batch["mask"])
      outputs.append(np.asarray(jax.device_get(fn(variables, batch["image"])))[mask])
      labels.append(np.asarray(batch["label"])[mask])
    return np.concatenate(outputs), np.concatenate(labels)

  def _frozen_parts(self, parts):
    """((h [n, D], labels [n]) of the train part, the same of the validation part): frozen h,
    computed once for the parts of a (count, seed), whichever protocols read them."""
    if self._frozen[0] is not parts:
      self._frozen = (
        parts,
        tuple(
          self._outputs(self._features, self._encoder.variables, part, self._config.train_split)
          for part in parts
        ),
      )
    return self._frozen[1]

  def _test(self):
    """h and labels of test_split (read once per init, at the end of its first cell)."""
    if self._test_features is None:
      self._test_features = self._outputs(
        self._features, self._encoder.variables, self._source, self._config.test_split
      )
    return self._test_features

  def _final(self, scores, labels, val_top1: float, choice: str) -> dict:
    result = le.scores_of(scores, labels, self._config.auroc)
    return dict(result, val_top1=val_top1, choice=choice)

  def _knn(self, parts, seed: int) -> dict:
    del seed  # The kNN draws nothing.
    (bank, bank_labels), (val, val_labels) = self._frozen_parts(parts)
    num_classes, t = self._source.num_classes, self._config.knn.temperature
    bank = common.l2_normalize(jnp.asarray(bank))

    def scores(queries, k):
      sims = common.l2_normalize(jnp.asarray(queries)) @ bank.T
      top_sims, top_labels = evaluators.top_k_neighbours(sims, jnp.asarray(bank_labels), k)
      votes = evaluators.knn_scores(top_sims, top_labels, num_classes=num_classes, temperature=t)
      return np.asarray(votes / jnp.sum(votes, axis=1, keepdims=True))

    ks = [int(k) for k in _listed(self._config.knn.k)]
    val_top1 = [le.top1(scores(val, k), val_labels) for k in ks]
    best = int(np.argmax(val_top1))
    test, test_labels = self._test()
    test_scores = np.concatenate(
      [scores(test[i : i + 1024], ks[best]) for i in range(0, len(test), 1024)]
    )
    return self._final(test_scores, test_labels, val_top1[best], f"k={ks[best]}")

  def _linear_probe(self, parts, seed: int) -> dict:
    """downstream.LinearHead (standardised) on frozen h: _probe."""
    best_val, variables, choice, predict = self._probe(parts, seed, standardize=True)
    test, test_labels = self._test()
    return self._final(np.asarray(predict(variables, test)), test_labels, best_val, choice)

  def _lp_ft(self, parts, seed: int) -> dict:
    """LP-FT (Kumar et al. 2022): fine-tuning whose head starts as a linear probe's (_probe,
    not standardised: a plain linear layer on h, the fine-tuning head)."""
    _, variables, choice, _ = self._probe(parts, seed, standardize=False)
    return self._finetune(parts, seed, head=variables["params"]["Dense_0"], probed=choice)

  def _probe_program(self, standardize: bool, batch: int, steps_per_epoch: int, scale: float):
    """(head, tx, jitted train step, jitted (variables, h) -> class probabilities) of a
    downstream.LinearHead on frozen h at `scale` x the optimizer's rate; built once per
    (standardize, batch, steps per epoch, scale), so that the seeds and counts of a size
    share its compilation."""
    key = ("probe", standardize, batch, steps_per_epoch, scale)
    if key not in self._programs:
      cfg = self._config.linear_probe
      head = downstream.LinearHead(self._source.num_classes, standardize, dense_init="zeros")
      optimizer = _scaled(cfg.optimizer, scale)
      schedule = optim.learning_rate_schedule(
        optimizer, batch, steps_per_epoch, cfg.epochs * steps_per_epoch
      )
      tx = optim.build_optimizer(optimizer, schedule)

      def forward(params, batch_stats, x):
        logits, updates = head.apply(
          {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
        )
        return logits, updates.get("batch_stats", {})

      step = downstream.make_classifier_step(lambda x: x, forward, tx)
      predict = jax.jit(lambda v, x: jax.nn.softmax(head.apply(v, x, train=False)))
      self._programs[key] = (head, tx, step, predict)
    return self._programs[key]

  def _probe(self, parts, seed: int, standardize: bool):
    """The best by validation top-1 of _probe_at each of linear_probe.lr_grid's scales.

    Returns:
      (its validation top-1, the head's variables then, on the host, the choice: 'epoch=E',
      with a grid 'lr=R, epoch=E', jitted (variables, h) -> class probabilities).
    """
    scales = _grid(self._config.linear_probe.lr_grid)
    best = max(
      (self._probe_at(parts, seed, standardize, scale) + (scale,) for scale in scales),
      key=lambda result: result[0],  # The first of equal ones: max keeps it.
    )
    val_top1, variables, epoch, predict, scale = best
    return val_top1, variables, _choice(self._config.linear_probe, scale, epoch), predict

  def _probe_at(self, parts, seed: int, standardize: bool, scale: float):
    """A downstream.LinearHead trained on frozen h by downstream.make_classifier_step at
    `scale` x the optimizer's rate, minibatches of the train part in a fresh order each
    epoch (numpy, seeded).

    Returns:
      (best validation top-1, the head's variables then, on the host, that epoch,
      jitted (variables, h) -> class probabilities).
    """
    cfg = self._config.linear_probe
    (h, y), (val, val_labels) = self._frozen_parts(parts)
    batch = min(cfg.batch_size, len(h))
    spe = len(h) // batch
    head, tx, step, predict = self._probe_program(standardize, batch, spe, scale)
    variables = head.init(jax.random.PRNGKey(seed), jnp.zeros((1, h.shape[1])), train=False)
    state = common.TrainState(
      step=jnp.zeros((), jnp.int32),
      params=variables["params"],
      batch_stats=variables.get("batch_stats", {}),
      opt_state=tx.init(variables["params"]),
      rng=jax.random.PRNGKey(seed),
    )
    rng = np.random.default_rng(seed)
    best = (-1.0, None, 0)
    for epoch in range(1, cfg.epochs + 1):
      order = rng.permutation(len(h))
      for i in range(spe):
        rows = order[i * batch : (i + 1) * batch]
        state, _ = step(state, {"image": h[rows, None], "label": y[rows]})
      if epoch % cfg.eval_every == 0 or epoch == cfg.epochs:
        variables = {"params": state.params, "batch_stats": state.batch_stats}
        val_top1 = le.top1(np.asarray(predict(variables, val)), val_labels)
        if val_top1 > best[0]:
          best = (val_top1, jax.device_get(variables), epoch)
    return best + (predict,)

  def _finetune_program(self, batch: int, steps_per_epoch: int, scale: float):
    """(jitted (encoder variables, head params, seed) -> state at step 0, jitted train step
    (downstream.make_finetune_step), jitted (variables, images) -> class probabilities) at
    `scale` x the optimizer's rate, built once per (batch, steps per epoch, scale), so that
    cells of a size share their compilation."""
    key = ("finetune", batch, steps_per_epoch, scale)
    if key not in self._programs:
      cfg, encoder = self._config.finetune, self._tuned
      cfg = ml_collections.ConfigDict(dict(cfg.to_dict(), optimizer=_scaled(cfg.optimizer, scale)))
      schedule = optim.learning_rate_schedule(
        cfg.optimizer, batch, steps_per_epoch, cfg.epochs * steps_per_epoch
      )
      # A random patch projection stays frozen, as the encoder was pretrained.
      tx = downstream.build_finetune_optimizer(
        cfg, schedule, freeze=encoder.pretrained.model.get("random_patch_projection", False)
      )

      def init(enc_vars, head_params, seed):
        params = {ENCODER: enc_vars["params"], "head": head_params}
        return common.TrainState(
          step=jnp.zeros((), jnp.int32),
          params=params,
          batch_stats={ENCODER: enc_vars["batch_stats"]},
          opt_state=tx.init(params),
          rng=jax.random.PRNGKey(seed),
        )

      def predict(variables, images):
        h = models.encode(encoder.module, encoder_variables(variables), images)
        return jax.nn.softmax(self._head.apply({"params": variables["params"]["head"]}, h))

      self._programs[key] = (
        jax.jit(init, out_shardings=mesh_lib.replicated(self._mesh)),
        downstream.make_finetune_step(encoder.module, self._head, tx),
        jax.jit(predict),
      )
    return self._programs[key]

  def _finetune(self, parts, seed: int, head=None, probed: str = "") -> dict:
    """The best by validation top-1 of _finetune_at each of finetune.lr_grid's scales,
    scored on test_split.

    The head starts at zero, or at `head` ({'kernel', 'bias'}: LP-FT's probe, whose
    choice `probed` the cell's choice names).
    """
    cfg = self._config.finetune
    best = max(
      (self._finetune_at(parts, seed, head, scale) + (scale,) for scale in _grid(cfg.lr_grid)),
      key=lambda result: result[0],  # The first of equal ones: max keeps it.
    )
    val_top1, variables, epoch, predict, scale = best
    test, test_labels = self._outputs(predict, variables, self._source, self._config.test_split)
    choice = _choice(cfg, scale, epoch)
    return self._final(
      test, test_labels, val_top1, f"probe {probed}, {choice}" if probed else choice
    )

  def _finetune_at(self, parts, seed: int, head, scale: float):
    """Encoder and a linear head on h, downstream.make_finetune_step on random crops at
    `scale` x the optimizer's rate; the head from zero or `head`.

    Returns:
      (best validation top-1, the variables then, on the host, that epoch, jitted
      (variables, images) -> class probabilities).
    """
    cfg, encoder, mesh = self._config.finetune, self._tuned, self._mesh
    train, validation = parts
    size = train.num_examples("", "")
    batch = min(cfg.batch_size, size // jax.device_count() * jax.device_count())
    spe = size // batch
    init, step, predict = self._finetune_program(batch, spe, scale)
    if head is None:
      head = self._head.init(jax.random.PRNGKey(seed), jnp.zeros((1, encoder.dim)))["params"]
    # Copies: the train step donates its state, and the encoder's variables serve every cell.
    state = init(jax.tree.map(lambda x: x.copy(), encoder.variables), head, seed)
    view = ml_collections.ConfigDict(
      dict(
        train_split=self._config.train_split,
        batch_size=batch,
        crop=cfg.crop.to_dict(),
        seed=seed,
        cache=True,  # The part is in memory, decoded.
        shuffle_buffer=size,
        data_threads=self._config.data_threads,
      )
    )
    batches = input_pipeline.train_batches(
      train,
      view,
      mesh_lib.batch_sharded(mesh),
      image_size=encoder.pretrained.image_size,
      num_views=1,
    )(0)
    best = (-1.0, None, 0)
    for epoch in range(1, cfg.epochs + 1):
      for _ in range(spe):
        state, _ = step(state, next(batches))
      if epoch % cfg.eval_every == 0 or epoch == cfg.epochs:
        variables = {"params": state.params, "batch_stats": state.batch_stats}
        val, val_labels = self._outputs(predict, variables, validation, self._config.train_split)
        val_top1 = le.top1(val, val_labels)
        if val_top1 > best[0]:
          best = (val_top1, jax.device_get(variables), epoch)
    return best + (predict,)


def _grid(lr_grid: str) -> list:
  """The scales of an lr_grid field ('0.3,1,3'), floats in its order."""
  return [float(scale) for scale in _listed(lr_grid)]


def _scaled(optimizer, scale: float):
  """A copy of an optimizer config with base_lr x scale."""
  return ml_collections.ConfigDict(dict(optimizer.to_dict(), base_lr=optimizer.base_lr * scale))


def _choice(part, scale: float, epoch: int) -> str:
  """What validation chose: 'epoch=E', with a grid of several scales 'lr=R, epoch=E' (R
  the base rate chosen, before the batch scaling)."""
  if len(_grid(part.lr_grid)) == 1:
    return f"epoch={epoch}"
  return f"lr={part.optimizer.base_lr * scale:.4g}, epoch={epoch}"


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
  summary = le.summarise(rows, _listed(config.inits), metrics)
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
