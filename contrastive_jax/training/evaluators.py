"""Evaluators: the kNN monitor and classifier accuracy, run by the job runner.

A job's config declares its evaluators in config.evaluators, a dict
{name: {kind, every, split, batch_size, ...}}; `every` is a duration ('10
epochs', '500 steps') and every evaluator also runs at a job's last step.
Metrics are named '<name>_top1' (a classifier adds '<name>_top5' with 5 classes
or more), as fractions of the split's images, each counted once. Adding a kind is one
class here and one entry in KINDS; the runner never changes.

The evaluator contract: a class in KINDS provides
  check_config(field, cfg, source) -> None, a staticmethod
      Raises ConfigError, naming the field (`field`, 'evaluators.<name>', and the
      key), for the fields of its own kind; check_config below checks those every
      kind has (kind, labels, batch_size, split) first. Runs before any compute.
  __init__(name, cfg, model: EvalModel, mesh, num_classes)
  at_start: bool, whether it also runs at step 0 of a fresh run.
  __call__(state) -> {metric name: float}.

Evaluation is sharded over the mesh: batches are split over the devices, and
the kNN bank stays sharded where it was computed (each device scores the
queries against its own part of the bank and the devices merge their top-k).
"""

from typing import Callable, NamedTuple, Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from contrastive_jax.core import durations
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import NonFiniteError
from contrastive_jax.methods import common


class EvalModel(NamedTuple):
  """What evaluators call: pure functions of (variables, uint8 images [B, S, S, 3]).

  variables: state -> the pytree passed to features and logits.
  features: -> float32 [B, D] representation h (eval-mode encoder).
  logits: -> float32 [B, C] class logits of the job's classifier, or None.
  dataset: (split, local_batch) -> an iterable of this process's eval batches,
    numpy {'image', 'label', 'mask'} (input_pipeline.eval_datasets).
  """

  variables: Callable
  features: Callable
  logits: Optional[Callable]
  dataset: Callable


def knn_scores(top_sims, top_labels, *, num_classes: int, temperature: float):
  """Weighted kNN class scores (Wu et al. 2018, Sec. 3.4).

  Args:
    top_sims: float32 [Q, k] cosine similarities of each query's k nearest
      bank entries (-inf for padding entries, which vote with weight 0).
    top_labels: int [Q, k] their labels.
    temperature: vote weight exp(sim / temperature), > 0.
  Returns:
    float32 [Q, num_classes]: each class's summed vote weight.
  """
  votes = jax.nn.one_hot(top_labels, num_classes) * jnp.exp(top_sims / temperature)[..., None]
  return jnp.sum(votes, axis=1)


def knn_vote(top_sims, top_labels, *, num_classes: int, temperature: float):
  """int32 [Q]: the class of largest knn_scores (same arguments); ties go to the smaller
  class index."""
  scores = knn_scores(top_sims, top_labels, num_classes=num_classes, temperature=temperature)
  return jnp.argmax(scores, axis=1).astype(jnp.int32)


def top_k_neighbours(sims, labels, k: int):
  """(top_sims [Q, k'], their labels [Q, k']) of sims [Q, N], labels [N]; k' = min(k, N)."""
  top_sims, top_idx = jax.lax.top_k(sims, min(k, sims.shape[1]))
  return top_sims, labels[top_idx]


class Knn:
  """Weighted kNN monitor: cosine similarity of L2-normalised h, k nearest vote.

  Config fields: split (queries), bank_split, k, temperature, batch_size.
  The bank is the whole bank_split, every query image counts once; encoder
  in eval mode. Calling it raises NonFiniteError, naming the counts, where h
  is NaN or infinite for any query or bank image.
  """

  at_start = True  # The initial encoder is the baseline the run improves on.

  @staticmethod
  def check_config(field: str, cfg, source):
    """Raises ConfigError for an unknown or empty bank_split of source, a k <= 0 or a
    temperature <= 0 (field: 'evaluators.<name>')."""
    source.num_examples(cfg.bank_split, f"{field}.bank_split")
    if cfg.k <= 0:
      raise ConfigError(f"{field}.k", cfg.k, "an integer > 0")
    if not cfg.temperature > 0:
      raise ConfigError(f"{field}.temperature", cfg.temperature, "> 0")

  def __init__(self, name, cfg, model: EvalModel, mesh, num_classes: int):
    self.name, self._model, self._mesh = name, model, mesh
    self._split, self._bank_split = cfg.split, cfg.bank_split
    self._local_batch = cfg.batch_size // jax.process_count()
    batch = mesh_lib.batch_sharded(mesh)
    self._embed = jax.jit(
      lambda v, x: common.l2_normalize(model.features(v, x)), out_shardings=batch
    )
    self._stack = jax.jit(
      lambda *xs: jnp.stack(xs),
      out_shardings=jax.sharding.NamedSharding(mesh, jax.P(None, mesh_lib.DATA_AXIS)),
    )
    axis = mesh_lib.DATA_AXIS

    def score(q, q_labels, q_mask, bank, bank_labels, bank_mask):
      # Every device scores all queries against its own part of the bank,
      # then the devices' top-k are merged into the global top-k.
      b = q.shape[0]
      queries = jax.lax.all_gather(q, axis, tiled=True)
      bank, bank_labels = bank.reshape(-1, bank.shape[-1]), bank_labels.reshape(-1)
      sims = jnp.matmul(queries, bank.T, precision=jax.lax.Precision.HIGHEST)
      sims = jnp.where(bank_mask.reshape(-1)[None, :], sims, -jnp.inf)
      local_sims, local_labels = top_k_neighbours(sims, bank_labels, cfg.k)
      merged_sims = jax.lax.all_gather(local_sims, axis, axis=1, tiled=True)
      merged_labels = jax.lax.all_gather(local_labels, axis, axis=1, tiled=True)
      top_sims, idx = jax.lax.top_k(merged_sims, min(cfg.k, merged_sims.shape[1]))
      pred = knn_vote(
        top_sims,
        jnp.take_along_axis(merged_labels, idx, axis=1),
        num_classes=num_classes,
        temperature=cfg.temperature,
      )
      mine = jax.lax.dynamic_slice_in_dim(pred, jax.lax.axis_index(axis) * b, b)
      return jax.lax.psum((jnp.sum((mine == q_labels) & q_mask), jnp.sum(q_mask)), axis)

    # A NaN or infinite h would vote as if it had no neighbours: its rows are counted, so
    # that the monitor refuses them rather than report a chance-level figure.
    self._non_finite = jax.jit(lambda h, mask: jnp.sum(mask & ~jnp.all(jnp.isfinite(h), -1)))
    data, bank_spec = jax.P(axis), jax.P(None, axis)
    self._score = jax.jit(
      jax.shard_map(
        score,
        mesh=mesh,
        in_specs=(data, data, data, bank_spec, bank_spec, bank_spec),
        out_specs=jax.P(),
      )
    )

  def _features(self, variables, split):
    """Yields (h sharded [B, D], labels, mask) for every batch of `split`."""
    ds = self._model.dataset(split, self._local_batch)
    for batch in mesh_lib.device_batches(ds, mesh_lib.batch_sharded(self._mesh)):
      yield self._embed(variables, batch["image"]), batch["label"], batch["mask"]

  def __call__(self, state) -> dict:
    variables = self._model.variables(state)
    bank = [self._stack(*parts) for parts in zip(*self._features(variables, self._bank_split))]
    bad_bank = self._non_finite(bank[0], bank[2])
    correct = total = bad = 0
    for q, labels, mask in self._features(variables, self._split):
      c, t = self._score(q, labels, mask, *bank)
      correct, total, bad = correct + c, total + t, bad + self._non_finite(q, mask)
    if bad or bad_bank:
      raise NonFiniteError(
        f"{self.name}: the encoder's h is NaN or infinite for {int(bad)} of the "
        f"{int(total)} query images ({self._split}) and {int(bad_bank)} bank images "
        f"({self._bank_split}); no figure is reported. A diverged encoder does this, and so "
        "does XLA:CPU's YNNPACK reduce fusion with model.dtype=bfloat16 in JAX 0.11 "
        "(docs/gpu.md: float32 on the CPU, or "
        "XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-individual_convolution,-reduce)"
      )
    return {f"{self.name}_top1": float(correct) / float(total)}


class Classifier:
  """Top-1 (and top-5 with >= 5 classes) accuracy of the job's classifier head.

  The pretraining job's classifier is its online probe; the linear-probe
  job's is its linear head. Config fields: split, batch_size.
  """

  at_start = False  # An untrained head says nothing.

  @staticmethod
  def check_config(field: str, cfg, source):
    """Raises nothing: a classifier has no fields besides those every kind has."""

  def __init__(self, name, cfg, model: EvalModel, mesh, num_classes: int):
    self.name, self._model, self._mesh = name, model, mesh
    self._split, self._local_batch = cfg.split, cfg.batch_size // jax.process_count()
    self._ks = tuple(k for k in (1, 5) if k <= num_classes)

    def counts(variables, batch):
      top = jax.lax.top_k(model.logits(variables, batch["image"]), max(self._ks))[1]
      hits = [
        jnp.any(top[:, :k] == batch["label"][:, None], axis=1) & batch["mask"] for k in self._ks
      ]
      return jnp.stack([jnp.sum(h) for h in hits] + [jnp.sum(batch["mask"])])

    self._counts = jax.jit(counts)

  def __call__(self, state) -> dict:
    variables = self._model.variables(state)
    totals = 0
    ds = self._model.dataset(self._split, self._local_batch)
    for batch in mesh_lib.device_batches(ds, mesh_lib.batch_sharded(self._mesh)):
      totals = totals + self._counts(variables, batch)  # Stays on the device until the end.
    totals = np.asarray(jax.device_get(totals), np.float64)
    return {f"{self.name}_top{k}": totals[i] / totals[-1] for i, k in enumerate(self._ks)}


KINDS = {"knn": Knn, "classifier": Classifier}


def check_config(evaluators, source, num_devices: int):
  """Raises ConfigError for an evaluator that cannot run (before any compute).

  Args:
    evaluators: config.evaluators, {name: {kind, every, split, batch_size, ...}}.
    source: the job's data source (splits and classes are checked against it).
  Raises:
    ConfigError: an unknown kind; any kind on a dataset without labels (both
      kinds vote or classify with labels); a batch_size that is not a positive
      multiple of num_devices; an unknown or empty split; then what the kind's
      own check_config raises for its fields (Knn: bank_split, k, temperature).
      (The interval's form is checked with the job's other durations; that it is
      at least one step, in build.)
  """
  for name, cfg in evaluators.items():
    field = f"evaluators.{name}"
    if cfg.get("kind") not in KINDS:
      raise ConfigError(f"{field}.kind", cfg.get("kind"), f"one of {sorted(KINDS)}")
    if source.num_classes is None:
      raise ConfigError(
        f"{field}.kind",
        cfg.kind,
        f"an evaluator that needs no labels: dataset {source.name!r} has none "
        "(remove this evaluator, or all of them with --config.evaluators='{}')",
      )
    if cfg.batch_size <= 0 or cfg.batch_size % num_devices:
      raise ConfigError(
        f"{field}.batch_size",
        cfg.batch_size,
        f"a positive multiple of the number of devices ({num_devices})",
      )
    source.num_examples(cfg.split, f"{field}.split")
    KINDS[cfg.kind].check_config(field, cfg, source)


def build(evaluators, model: EvalModel, mesh, num_classes: int, steps_per_epoch: int):
  """[(every in steps, evaluator)] for config.evaluators (checked by check_config).

  Raises:
    ConfigError: an `every` that is not a duration or is 0 steps.
  """
  return [
    (
      durations.to_steps(cfg.every, f"evaluators.{name}.every", steps_per_epoch),
      KINDS[cfg.kind](name, cfg, model, mesh, num_classes),
    )
    for name, cfg in evaluators.items()
  ]


def log(step: int, results: dict):
  """One console line with the evaluation results of a step."""
  logging.info("Step %d: %s.", step, ", ".join(f"{k} {v:.4f}" for k, v in sorted(results.items())))
