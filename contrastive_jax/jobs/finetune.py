"""The fine-tuning job (config.job='finetune'): the whole encoder and a linear head, few labels.

  python -m contrastive_jax.main --config=configs/finetune.py \
      --config.pretrain_workdir=PRETRAIN_DIR --config.label_fraction=0.01 --workdir=DIR

The semi-supervised protocol of SimCLR (Chen et al. 2020, Sec. 6 and Appendix
B.5): the encoder of a pretraining checkpoint (or, with random_init, the
pretraining run's initialisation of it: the baseline; training/restore.py), with
config.projector_layers of its projection head's hidden layers after it (SimCLR v2's
fine-tuning from the head's first layer: restore.with_head_layers), and a
zero-initialised linear head on its output h are trained together, by cross-entropy, on
a class-balanced subset of the train split's labels (labelled.select_labelled:
label_fraction of each class, chosen by label_seed alone, so that every run,
seed and process count trains on the same images); top-1 and top-5 on every
test image (the config's 'classifier' evaluator). The subset's ids and labels
are written to WORKDIR/labelled_subset.csv.

BatchNorm trains in train mode: batch statistics over the global batch (as
SimCLR's global BN), and running statistics that start from the restored ones
and follow the fine-tuned encoder (momentum 0.9), used at evaluation. Frozen
statistics would describe the pretraining views' activations, which drift
away as the weights change.
"""

import csv
import functools
import io

import jax
import jax.numpy as jnp
import tensorflow as tf

from contrastive_jax import models
from contrastive_jax.core import checkpointing
from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core.errors import ResumeError
from contrastive_jax.data import labelled
from contrastive_jax.methods import encoder_variables
from contrastive_jax.training import downstream
from contrastive_jax.training import evaluators
from contrastive_jax.training import restore
from contrastive_jax.training import runner

SUBSET_FILE = "labelled_subset.csv"


def check_config(config, num_devices: int):
  """Raises ConfigError for fine-tuning fields that cannot run (before any compute)."""
  downstream.check_config(config, num_devices)
  if not 0 < config.label_fraction <= 1:
    raise ConfigError(
      "label_fraction",
      config.label_fraction,
      "in (0, 1]: the fraction of each class's train labels to fine-tune on (e.g. 0.01, 0.1 or 1)",
    )
  if config.label_seed < 0:
    raise ConfigError("label_seed", config.label_seed, "an integer >= 0")
  if not isinstance(config.projector_layers, int) or config.projector_layers < 0:
    raise ConfigError(
      "projector_layers",
      config.projector_layers,
      "an integer >= 0: how many of the projection head's hidden layers to fine-tune from "
      "(0: from h)",
    )
  downstream.check_multipliers(config, "")


def subset_csv(subset: labelled.LabelledSubset) -> str:
  """The text of labelled_subset.csv: a header 'id,label', then one row per image in read order."""
  text = io.StringIO()
  writer = csv.writer(text, lineterminator="\n")
  writer.writerow(("id", "label"))
  writer.writerows(zip(subset.ids, subset.labels.tolist()))
  return text.getvalue()


def record_subset(subset: labelled.LabelledSubset, workdir: str, resumed: bool):
  """Writes WORKDIR/labelled_subset.csv (process 0), or, resuming, checks it against `subset`.

  The file is written whole under a temporary name and renamed, so any
  process that sees it sees it complete.

  Raises:
    JobError: resuming, the file lists another subset than the one selected
      now (the dataset changed under the same name): the checkpoint was
      trained on the file's images.
  """
  path, text = f"{workdir}/{SUBSET_FILE}", subset_csv(subset)
  if resumed and tf.io.gfile.exists(path):
    with tf.io.gfile.GFile(path) as f:
      if f.read() != text:
        raise JobError(
          f"{path} lists another labelled subset than label_fraction and "
          f"label_seed select from dataset {subset.name!r} now: the dataset "
          "changed since this run started. Use a new workdir"
        )
    return
  if jax.process_index() == 0:
    files.write_atomic(path, text)


def build(config, mesh, saved_config, workdir: str) -> runner.Task:
  """The fine-tuning Task for runner.run (downstream.build_task).

  Raises:
    ConfigError: see restore.restore_encoder and labelled.select_labelled; an
      unlabeled dataset; a batch larger than the labelled subset; an
      evaluator that cannot run.
    JobError: see record_subset.
  """
  config = config.copy_and_resolve_references()
  source = downstream.labelled_source(config, "fine-tuning")
  subset = labelled.LabelledSubset(
    source, config.train_split, config.label_fraction, config.label_seed
  )
  size = subset.num_examples(config.train_split, "train_split")
  if size < config.batch_size:
    raise ConfigError(
      "batch_size",
      config.batch_size,
      f"at most the labelled subset's size ({size} images: label_fraction "
      f"{config.label_fraction} of split {config.train_split!r})",
    )
  encoder = restore.with_head_layers(
    config,
    restore.restore_encoder(config, mesh, saved_config),
    config.projector_layers,
    "projector_layers",
    mesh,
  )
  if saved_config is not None:  # Named as changed fields, before the subset file is compared.
    differences = [
      d
      for d in checkpointing.config_differences(saved_config.to_dict(), config, ())
      if d[0] in ("label_fraction", "label_seed")
    ]
    if differences:
      raise ResumeError(f"{workdir}/checkpoints", differences, runner.MAY_CHANGE_ON_RESUME)
  record_subset(subset, workdir, resumed=saved_config is not None)
  head = downstream.finetune_head(source.num_classes)

  def make_trainer(schedule):
    tx = downstream.build_finetune_optimizer(config, schedule, encoder)

    def init_state(enc_vars):
      head_params = head.init(jax.random.PRNGKey(config.seed), jnp.zeros((1, encoder.dim)))
      return downstream.finetune_state(tx, enc_vars, head_params["params"], config.seed)

    eval_model = evaluators.EvalModel(
      variables=lambda state: {"params": state.params, "batch_stats": state.batch_stats},
      features=lambda variables, images: models.encode(
        encoder.module, encoder_variables(variables), images
      ),
      logits=downstream.finetune_logits(encoder.module, head),
      dataset=None,
    )
    # The encoder's variables are an argument, not constants baked into the program.
    init = functools.partial(
      jax.jit(init_state, out_shardings=mesh_lib.replicated(mesh)), encoder.variables
    )
    return downstream.Trainer(
      init=init,
      train_step=downstream.make_finetune_step(encoder.module, head, tx),
      eval_model=eval_model,
    )

  return downstream.build_task(
    config,
    mesh,
    source=source,
    train_data=subset,
    encoder=encoder,
    make_trainer=make_trainer,
    verb="Fine-tuning",
    detail=f" on {size} labelled images (label_fraction {config.label_fraction:g} of "
    f"{config.train_split!r})",
  )
