"""The pretraining step a config builds (setup -> Run): the method's model, optimizer, state
initialiser and jitted train step, with the online probe on a labelled dataset.

TensorFlow-free (no input pipeline here), so that the pretraining job, the benchmarks
and benchmarks/device.py on an image with JAX alone build one and the same step.
"""

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import optax

from contrastive_jax import models
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import runtime
from contrastive_jax.data import augment
from contrastive_jax.methods import common
from contrastive_jax.methods import get_method
from contrastive_jax.methods import optim
from contrastive_jax.methods import optional_attributes
from contrastive_jax.methods import run_keys


def views(config):
  """The (view 1, view 2) on-device augmentation settings of the config."""
  return (
    augment.ViewAugment.from_config(config.augment.view1, "augment.view1"),
    augment.ViewAugment.from_config(config.augment.view2, "augment.view2"),
  )


def online_probe(config, num_classes: int) -> common.OnlineProbe:
  """The online probe of a dataset with num_classes classes.

  A zero-initialised linear layer on h trained with Adam at
  config.online_probe.learning_rate (Adam's per-parameter step fits the scale
  of h as it changes during pretraining without retuning); SimCLR (Chen et al.
  2020, Appendix B.6) and BYOL (Grill et al. 2020, Appendix C.1) train such a
  classifier on stop_gradient(h) alongside pretraining. Every pretraining run
  on a labelled dataset trains it, so that the state's structure does not
  depend on which evaluators a resumed run declares.
  """
  head = nn.Dense(num_classes, kernel_init=nn.initializers.zeros)
  return common.OnlineProbe(head, optax.adam(config.online_probe.learning_rate))


class Run(NamedTuple):
  """What a config builds: the model, its lr schedule, init and train step."""

  model: Any
  schedule: Callable
  init: Callable  # () -> TrainState at step 0, replicated on the mesh.
  train_step: Callable  # (state, batch) -> (state, metrics), jitted, state donated.
  probe: Any  # common.OnlineProbe or None.


def setup(
  config,
  mesh,
  steps_per_epoch: int,
  num_steps: int,
  num_classes: int = 0,
  start=None,
) -> Run:
  """Builds the method's model, optimizer, state initialiser and train step.

  num_classes > 0 (a labelled dataset) adds the online probe; 0, none.
  start: None, or (replace, variables): step 0's state is replace(drawn state,
  variables), e.g. (methods.with_encoder, an encoder's {'params', 'batch_stats'}
  that every network of the state starts from) or (dino.with_imported, a DINO
  checkpoint's networks and centre).
  """
  key = (
    config.to_json_best_effort(sort_keys=True),
    mesh,
    steps_per_epoch,
    num_steps,
    num_classes,
    runtime.cpu_tweaks(),
  )
  if key not in _PROGRAMS:
    while len(_PROGRAMS) >= _KEPT_PROGRAMS:
      _PROGRAMS.pop(next(iter(_PROGRAMS)))
    _PROGRAMS[key] = _programs(config, mesh, steps_per_epoch, num_steps, num_classes)
  model, schedule, init_state, train_step, probe = _PROGRAMS[key]
  replicated = mesh_lib.replicated(mesh)
  if start is not None:
    drawn, (replace, variables) = init_state, start
    replace = jax.jit(replace, out_shardings=replicated, donate_argnums=0)
    init_state = lambda: replace(drawn(), variables)
  read_frozen = optional_attributes(config.method).frozen_variables
  if read_frozen is not None:  # Arguments of the executable, not constants of its program.
    frozen, step = read_frozen(config, mesh), train_step
    train_step = lambda state, batch: step(state, batch, frozen)
  return Run(model, schedule, init_state, train_step, probe)


# The programs of this process's last few setups, by everything they read: the whole config,
# the mesh, the run's length, the probe's classes and whether the CPU-only lowerings are on
# (models/conv.py reads it when tracing). A run of the same config again in one process (a
# resumed run, the tests' repeated tiny runs) reuses jax.jit's traced, lowered and compiled
# train step and initialiser instead of building them again.
_PROGRAMS = {}
_KEPT_PROGRAMS = 4


def _programs(config, mesh, steps_per_epoch: int, num_steps: int, num_classes: int):
  """(model, schedule, jitted init, jitted train step, probe) of a setup."""
  config = (
    config.copy_and_resolve_references()
  )  # What the programs trace, whatever the caller changes.
  method = get_method(config.method)
  schedule = optim.learning_rate_schedule(
    config.optimizer, config.batch_size, steps_per_epoch, num_steps
  )
  tx = optim.build_optimizer(
    config.optimizer,
    schedule,
    freeze=config.model.get("random_patch_projection", False),
    steps_per_epoch=steps_per_epoch,
    total_steps=num_steps,
  )
  model = method.build_model(config)
  probe = online_probe(config, num_classes) if num_classes > 0 else None
  init_rng, rng = run_keys(config.seed)

  def init():
    state = method.init_state(config, model, tx, init_rng, rng)
    if probe is not None:
      state = state.replace(probe=probe.init(init_rng, models.encoder_width(config.model)))
    return state

  init_state = jax.jit(init, out_shardings=mesh_lib.replicated(mesh))
  train_step = jax.jit(
    method.make_train_step(
      config, model, tx, views(config), mesh, common.RunLength(num_steps, steps_per_epoch), probe
    ),
    donate_argnums=0,
  )
  return model, schedule, init_state, train_step, probe
