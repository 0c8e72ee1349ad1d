"""The label-efficiency protocols: what one init scores on one labelled subset.

A protocol (PROTOCOLS: name -> function (cells, parts, seed) -> scores) fits on
the train part of a subset (data/in_memory.read_parts), makes every choice on
its validation part, and scores test_split with the model so chosen:
- 'knn': the weighted kNN of the frozen encoder's h (evaluators.knn_scores; bank:
  the train part), k of config.knn.k chosen by validation top-1.
- 'linear_probe': downstream.LinearHead (standardised) trained on the frozen h of
  the train part's images, centre-cropped as for evaluation (no augmentation: the
  features are computed once per subset), downstream.make_probe_step.
- 'finetune': the encoder and a zero-initialised linear head trained together on
  random crops (downstream.make_finetune_step, BN in train mode), from h or, with
  finetune.projector_layers, from that many of its projection head's hidden layers.
- 'lp_ft': LP-FT (Kumar et al. 2022): that fine-tuning from the head of a linear
  probe (not standardised: a plain linear layer on h, the fine-tuning head).
The probe and fine-tuning share one loop (fit_and_select: train, validate every
eval_every epochs and at the last, keep the best) and one learning-rate grid
(select_rate: each multiplier of lr_grid fitted, the best by validation kept).
"""

from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from contrastive_jax import models
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.data import input_pipeline
from contrastive_jax.methods import common
from contrastive_jax.methods import optim
from contrastive_jax.training import downstream
from contrastive_jax.training import evaluators
from contrastive_jax.training import label_efficiency as le
from contrastive_jax.training import restore

# Test images scored by one kNN call.
KNN_QUERIES = 1024


def listed(value) -> list:
  """The entries of a comma-separated field ('10,20,50'), stripped, empty ones left out."""
  return [v.strip() for v in str(value).split(",") if v.strip()]


def grid(lr_grid: str) -> list:
  """The scales of an lr_grid field ('0.3,1,3'), floats in its order (ValueError if not)."""
  return [float(scale) for scale in listed(lr_grid)]


class Cells:
  """What the cells of one init share: its encoders, the test split's h, compiled programs.

  Args:
    config: the label-efficiency job's config.
    mesh: the device mesh.
    source: the labelled data source (its test_split is scored).
    encoder: what kNN and the probes read (restore.Encoder).
    tuned: what fine-tuning trains: encoder, or it with finetune.projector_layers of its
      projection head after it (restore.with_head_layers).
  """

  def __init__(self, config, mesh, source, encoder: restore.Encoder, tuned: restore.Encoder):
    self.config, self.mesh, self.source, self.encoder = config, mesh, source, encoder
    self.tuned = tuned
    self.features = jax.jit(lambda v, x: models.encode(encoder.module, v, x))
    self.head = downstream.finetune_head(source.num_classes)
    self._eval_crop = input_pipeline.EvalCrop.of(encoder.pretrained)
    self._test_features = None  # h of test_split, computed at the end of the first cell.
    self._programs = {}  # Jitted programs by their shapes and rates (program).
    self._frozen = (None, None)  # (parts, their frozen h): the last parts' (frozen_parts).

  def program(self, key: tuple, build: Callable):
    """build()'s result, built once per key, so that cells of one size share compilations."""
    if key not in self._programs:
      self._programs[key] = build()
    return self._programs[key]

  def outputs(self, fn, variables, source, split: str):
    """(fn(variables, images) of every image of split, as numpy [N, ...], labels int [N])."""
    ds = input_pipeline.eval_dataset(
      source,
      split,
      local_batch=self.config.eval_batch_size,
      eval_crop=self._eval_crop,
      threads=self.config.data_threads,
    )
    outputs, labels = [], []
    for batch in mesh_lib.device_batches(ds.as_numpy_iterator(), mesh_lib.batch_sharded(self.mesh)):
      mask = np.asarray(batch["mask"])
      outputs.append(np.asarray(jax.device_get(fn(variables, batch["image"])))[mask])
      labels.append(np.asarray(batch["label"])[mask])
    return np.concatenate(outputs), np.concatenate(labels)

  def frozen_parts(self, parts):
    """((h [n, D], labels [n]) of the train part, the same of the validation part): frozen h,
    computed once for the parts of a (count, seed), whichever protocols read them."""
    if self._frozen[0] is not parts:
      self._frozen = (
        parts,
        tuple(
          self.outputs(self.features, self.encoder.variables, part, self.config.train_split)
          for part in parts
        ),
      )
    return self._frozen[1]

  def test(self):
    """h and labels of test_split (read once per init, at the end of its first cell)."""
    if self._test_features is None:
      self._test_features = self.outputs(
        self.features, self.encoder.variables, self.source, self.config.test_split
      )
    return self._test_features

  def final(self, scores, labels, val_top1: float, choice: str) -> dict:
    """A cell's row: le.scores_of the test scores, the validation top-1 and the choice."""
    return dict(le.scores_of(scores, labels, self.config.auroc), val_top1=val_top1, choice=choice)


def fit_and_select(state, step, epoch_batches: Callable, epochs: int, eval_every: int, validate):
  """Trains `epochs` epochs; validates after every eval_every-th and the last; keeps the best.

  Args:
    state: common.TrainState at step 0 (donated to step).
    step: (state, batch) -> (state, metrics).
    epoch_batches: epoch (1-based) -> the batches of that epoch.
    validate: {'params', 'batch_stats'} -> validation top-1.
  Returns:
    (best validation top-1, the variables then on the host, that epoch): the first of
    equal ones.
  """
  best = (-1.0, None, 0)
  for epoch in range(1, epochs + 1):
    for batch in epoch_batches(epoch):
      state, _ = step(state, batch)
    if epoch % eval_every == 0 or epoch == epochs:
      variables = {"params": state.params, "batch_stats": state.batch_stats}
      val_top1 = validate(variables)
      if val_top1 > best[0]:
        best = (val_top1, jax.device_get(variables), epoch)
  return best


def select_rate(part, fit: Callable):
  """The best by validation top-1 of fit(scale) at each of part.lr_grid's scales.

  Args:
    part: config.linear_probe or config.finetune.
    fit: scale -> (validation top-1, variables, epoch, predict), e.g. fit_and_select's.
  Returns:
    (its validation top-1, variables, the choice: 'epoch=E' or, with a grid of several
    scales, 'lr=R, epoch=E' (R the base rate chosen, before the batch scaling), predict).
  """
  scales = grid(part.lr_grid)
  best = max(
    (fit(scale) + (scale,) for scale in scales),
    key=lambda result: result[0],  # The first of equal ones: max keeps it.
  )
  val_top1, variables, epoch, predict, scale = best
  choice = f"epoch={epoch}"
  if len(scales) > 1:
    choice = f"lr={part.optimizer.base_lr * scale:.4g}, {choice}"
  return val_top1, variables, choice, predict


def _scaled(optimizer, scale: float):
  """A copy of an optimizer config with base_lr x scale."""
  return ml_collections.ConfigDict(dict(optimizer.to_dict(), base_lr=optimizer.base_lr * scale))


def knn(cells: Cells, parts, seed: int) -> dict:
  """Weighted kNN of the frozen h on the train part; k of knn.k chosen by validation top-1."""
  del seed  # The kNN draws nothing.
  (bank, bank_labels), (val, val_labels) = cells.frozen_parts(parts)
  num_classes, t = cells.source.num_classes, cells.config.knn.temperature
  bank = common.l2_normalize(jnp.asarray(bank))

  def scores(queries, k):
    sims = common.l2_normalize(jnp.asarray(queries)) @ bank.T
    top_sims, top_labels = evaluators.top_k_neighbours(sims, jnp.asarray(bank_labels), k)
    votes = evaluators.knn_scores(top_sims, top_labels, num_classes=num_classes, temperature=t)
    return np.asarray(votes / jnp.sum(votes, axis=1, keepdims=True))

  ks = [int(k) for k in listed(cells.config.knn.k)]
  val_top1 = [le.top1(scores(val, k), val_labels) for k in ks]
  best = int(np.argmax(val_top1))
  test, test_labels = cells.test()
  test_scores = np.concatenate(
    [scores(test[i : i + KNN_QUERIES], ks[best]) for i in range(0, len(test), KNN_QUERIES)]
  )
  return cells.final(test_scores, test_labels, val_top1[best], f"k={ks[best]}")


def linear_probe(cells: Cells, parts, seed: int) -> dict:
  """downstream.LinearHead (standardised) on frozen h: _probe."""
  best_val, variables, choice, predict = _probe(cells, parts, seed, standardize=True)
  test, test_labels = cells.test()
  return cells.final(np.asarray(predict(variables, test)), test_labels, best_val, choice)


def lp_ft(cells: Cells, parts, seed: int) -> dict:
  """LP-FT: finetune whose head starts as a linear probe's (_probe, not standardised)."""
  _, variables, choice, _ = _probe(cells, parts, seed, standardize=False)
  return finetune(cells, parts, seed, head=variables["params"]["Dense_0"], probed=choice)


def finetune(cells: Cells, parts, seed: int, head=None, probed: str = "") -> dict:
  """Encoder and linear head fine-tuned at each of finetune.lr_grid's scales (select_rate),
  the best scored on test_split.

  The head starts at zero, or at `head` ({'kernel', 'bias'}: LP-FT's probe, whose
  choice `probed` the cell's choice names).
  """
  val_top1, variables, choice, predict = select_rate(
    cells.config.finetune, lambda scale: _finetune_at(cells, parts, seed, head, scale)
  )
  test, test_labels = cells.outputs(predict, variables, cells.source, cells.config.test_split)
  return cells.final(test, test_labels, val_top1, f"probe {probed}, {choice}" if probed else choice)


def _probe(cells: Cells, parts, seed: int, standardize: bool):
  """select_rate of _probe_at over linear_probe.lr_grid: (validation top-1, the head's
  variables on the host, the choice, jitted (variables, h) -> class probabilities)."""
  return select_rate(
    cells.config.linear_probe, lambda scale: _probe_at(cells, parts, seed, standardize, scale)
  )


def _probe_program(cells: Cells, standardize: bool, batch: int, steps_per_epoch: int, scale):
  """(head, tx, jitted train step, jitted (variables, h) -> class probabilities) of a
  downstream.LinearHead on frozen h at `scale` x the optimizer's rate."""
  cfg = cells.config.linear_probe
  head = downstream.LinearHead(cells.source.num_classes, standardize, dense_init="zeros")
  optimizer = _scaled(cfg.optimizer, scale)
  schedule = optim.learning_rate_schedule(
    optimizer, batch, steps_per_epoch, cfg.epochs * steps_per_epoch
  )
  tx = optim.build_optimizer(optimizer, schedule)
  predict = jax.jit(lambda v, x: jax.nn.softmax(head.apply(v, x, train=False)))
  return head, tx, downstream.make_probe_step(head, tx), predict


def _probe_at(cells: Cells, parts, seed: int, standardize: bool, scale: float):
  """A downstream.LinearHead trained on frozen h at `scale` x the optimizer's rate,
  minibatches of the train part in a fresh order each epoch (numpy, seeded): fit_and_select's
  result and the jitted (variables, h) -> class probabilities."""
  cfg = cells.config.linear_probe
  (h, y), (val, val_labels) = cells.frozen_parts(parts)
  batch = min(cfg.batch_size, len(h))
  spe = len(h) // batch
  head, tx, step, predict = cells.program(
    ("probe", standardize, batch, spe, scale),
    lambda: _probe_program(cells, standardize, batch, spe, scale),
  )
  state = downstream.probe_state(head, tx, h.shape[1], seed)
  rng = np.random.default_rng(seed)

  def epoch_batches(epoch: int) -> Iterable:
    del epoch  # Each epoch draws its order from rng.
    order = rng.permutation(len(h))
    for i in range(spe):
      rows = order[i * batch : (i + 1) * batch]
      yield {"image": h[rows, None], "label": y[rows]}

  def validate(variables):
    return le.top1(np.asarray(predict(variables, val)), val_labels)

  best = fit_and_select(state, step, epoch_batches, cfg.epochs, cfg.eval_every, validate)
  return best + (predict,)


def _finetune_program(cells: Cells, batch: int, steps_per_epoch: int, scale: float):
  """(jitted (encoder variables, head params, seed) -> state at step 0, jitted train step,
  jitted (variables, images) -> class probabilities) at `scale` x the optimizer's rate."""
  cfg, encoder = cells.config.finetune, cells.tuned
  cfg = ml_collections.ConfigDict(dict(cfg.to_dict(), optimizer=_scaled(cfg.optimizer, scale)))
  schedule = optim.learning_rate_schedule(
    cfg.optimizer, batch, steps_per_epoch, cfg.epochs * steps_per_epoch
  )
  tx = downstream.build_finetune_optimizer(cfg, schedule, encoder)
  logits = downstream.finetune_logits(encoder.module, cells.head)
  return (
    jax.jit(
      lambda enc_vars, head, seed: downstream.finetune_state(tx, enc_vars, head, seed),
      out_shardings=mesh_lib.replicated(cells.mesh),
    ),
    downstream.make_finetune_step(encoder.module, cells.head, tx),
    jax.jit(lambda variables, images: jax.nn.softmax(logits(variables, images))),
  )


def _finetune_at(cells: Cells, parts, seed: int, head, scale: float):
  """Encoder and a linear head on h, downstream.make_finetune_step on random crops at
  `scale` x the optimizer's rate, the head from zero or `head`: fit_and_select's result and
  the jitted (variables, images) -> class probabilities."""
  config, encoder = cells.config, cells.tuned
  cfg = config.finetune
  train, validation = parts
  size = train.num_examples("", "")
  batch = min(cfg.batch_size, size // jax.device_count() * jax.device_count())
  spe = size // batch
  init, step, predict = cells.program(
    ("finetune", batch, spe, scale), lambda: _finetune_program(cells, batch, spe, scale)
  )
  if head is None:
    head = cells.head.init(jax.random.PRNGKey(seed), jnp.zeros((1, encoder.dim)))["params"]
  # Copies: the train step donates its state, and the encoder's variables serve every cell.
  state = init(jax.tree.map(lambda x: x.copy(), encoder.variables), head, seed)
  view = ml_collections.ConfigDict(
    dict(
      train_split=config.train_split,
      batch_size=batch,
      crop=cfg.crop.to_dict(),
      seed=seed,
      cache=True,  # The part is in memory, decoded.
      shuffle_buffer=size,
      data_threads=config.data_threads,
    )
  )
  batches = downstream.train_batches(train, view, cells.mesh, encoder)(0)

  def validate(variables):
    scores, labels = cells.outputs(predict, variables, validation, config.train_split)
    return le.top1(scores, labels)

  best = fit_and_select(
    state, step, lambda _: (next(batches) for _ in range(spe)), cfg.epochs, cfg.eval_every, validate
  )
  return best + (predict,)


# The protocols by name, as config.protocols lists them: (cells, parts, seed) -> a cell's scores.
PROTOCOLS = {"knn": knn, "linear_probe": linear_probe, "finetune": finetune, "lp_ft": lp_ft}
