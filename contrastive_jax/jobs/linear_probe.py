"""The linear-probe job (config.job='linear_probe'): a linear classifier on frozen h.

  python -m contrastive_jax.main --config=configs/linear_probe.py \
      --config.pretrain_workdir=PRETRAIN_DIR --workdir=PROBE_DIR

Restores only the encoder of the pretraining workdir's checkpoint (or the
pretraining run's initialisation of it, the baseline; training/restore.py). The
encoder stays frozen: eval-mode BN, no gradient, variables never written.
Protocol: features h before the projection head, random crop-and-flip on
train images, a linear classifier trained with the recipe of config.preset
(probe_presets.LINEAR_PROBE_PRESETS: 'auto' picks the linear evaluation of the
checkpoint's method's reference, 'standardised' this project's probe, which
standardises h with an affine-free BN so that one learning rate fits every
encoder, the random baseline included); accuracy on every test image once
(the config's 'classifier' evaluator).
"""

import jax

from contrastive_jax import methods
from contrastive_jax import models
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.methods import optim
from contrastive_jax.training import downstream
from contrastive_jax.training import evaluators
from contrastive_jax.training import probe_presets
from contrastive_jax.training import restore
from contrastive_jax.training import runner

# 'auto' runs the preset named as the checkpoint's method: every key of methods.METHODS
# has one (tests/test_linear_probe.py).
PRESETS = ("auto",) + tuple(probe_presets.LINEAR_PROBE_PRESETS)


def check_config(config, num_devices: int):
  """Raises ConfigError for probe fields that cannot run (before any compute).

  With preset 'auto' the method is not known before the checkpoint is read,
  so the config is checked as each method's preset would fill it.
  """
  if config.preset not in PRESETS:
    raise ConfigError("preset", config.preset, f"one of {list(PRESETS)}")
  for name in methods.METHODS if config.preset == "auto" else (config.preset,):
    filled = probe_presets.fill_probe_preset(config, name)
    downstream.check_config(filled, num_devices)
    if filled.head.init not in downstream.HEAD_INITS:
      raise ConfigError("head.init", filled.head.init, f"one of {sorted(downstream.HEAD_INITS)}")


def build(config, mesh, saved_config, workdir) -> runner.Task:
  """The probe Task for runner.run (downstream.build_task).

  Resuming a probe started on "the latest" checkpoint keeps probing the
  encoder it started with (saved_config.pretrain_step). The returned Task's
  config is resolved: config.preset names the preset that ran and its fields
  hold the preset's values.

  Raises:
    ConfigError: see restore.restore_encoder; an unlabeled dataset; a
      batch larger than the train split; an evaluator that cannot run.
  """
  del workdir  # The probe writes nothing but what the runner writes.
  config = config.copy_and_resolve_references()
  source = downstream.labelled_source(config, "the linear probe")
  encoder = restore.restore_encoder(config, mesh, saved_config)
  enc_vars = encoder.variables
  preset = encoder.pretrained.method if config.preset == "auto" else config.preset
  config = probe_presets.fill_probe_preset(config, preset)
  config.preset = preset
  head = downstream.LinearHead(source.num_classes, config.head.standardize, config.head.init)

  def make_trainer(schedule):
    tx = optim.build_optimizer(config.optimizer, schedule)

    def init():
      return downstream.probe_state(head, tx, encoder.dim, config.seed)

    step_fn = downstream.make_probe_step(head, tx, encoder.module)

    def logits(variables, images):
      enc, head_vars = variables
      return head.apply(head_vars, models.encode(encoder.module, enc, images), train=False)

    eval_model = evaluators.EvalModel(
      variables=lambda state: (
        enc_vars,
        {"params": state.params, "batch_stats": state.batch_stats},
      ),
      features=lambda variables, images: models.encode(encoder.module, variables[0], images),
      logits=logits,
      dataset=None,
    )
    return downstream.Trainer(
      init=jax.jit(init, out_shardings=mesh_lib.replicated(mesh)),
      train_step=lambda state, batch: step_fn(state, batch, enc_vars),
      eval_model=eval_model,
    )

  method = " (the method's)" if preset == encoder.pretrained.method else ""
  return downstream.build_task(
    config,
    mesh,
    source=source,
    train_data=source,
    encoder=encoder,
    make_trainer=make_trainer,
    verb="Probing",
    detail=f" with the linear-probe preset {preset!r}{method}",
  )
