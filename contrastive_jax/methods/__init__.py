"""Contrastive methods, one module each: loss, model and state update together.

The method contract: a module registered in METHODS provides

  check_config(config, num_train_examples) -> None
      Raises ConfigError, naming the field, for the method's own fields
      (temperature, moco.*, byol.*, heads); runs before any compute.
      num_train_examples: images in the train split (MoCo's queue holds at
      most that many keys; B <= N is the runner's check for every method).
  build_model(config) -> heads.ContrastiveModel
      The trained network, whose submodule 'encoder' is the representation
      h that downstream jobs use.
  init_state(config, model, tx, init_rng, rng) -> common.TrainState
      The state at step 0 (common.TrainState.create): params and batch_stats
      from model.init, the optimizer state, rng as the run's base key, and the
      method's own state in `extra` (MoCo's key encoder and queue, MoCo v3's
      momentum encoder, BYOL's target network, DINO's teacher and centre).
  make_train_step(config, model, tx, views, mesh, length, probe=None)
      -> train_step(state, batch) -> (state, metrics), built with
      common.build_train_step (so every method gets the health
      scalars, the online probe, the augmentation keys and the sharding of
      the others); views: (view 1, view 2) augment.ViewAugment; length:
      common.RunLength, the run's num_steps and steps_per_epoch, which the
      method's schedules follow (EMA momentum ramps, DINO's teacher
      temperature); probe: common.OnlineProbe or None. batch holds 'image'
      uint8 [B, 2, S, S, 3] and 'label' int32 [B]; metrics are float32 scalars
      including 'loss'.

Every method takes every parameter; one whose result does not depend on a parameter
ignores it (SimCLR's step: length; every method but MoCo: num_train_examples).

Every module keeps the student or online encoder at state.params['encoder'] and
state.batch_stats['encoder'] (encoder_variables; absent for an encoder without BN, a
ViT): the online probe's.

A module may also provide the optional attributes that OptionalAttributes declares,
with the value each takes where a module lacks it; the package reads them only through
optional_attributes(name), never from the module itself:

  LOCAL_CROPS = True (default False)
      The method also takes config.local_crops and then batch['local_image'] uint8
      [B, N, s, s, 3] (multi-crop: DINO); the pretraining job refuses local_crops for
      the others.
  EVALUATED_ENCODER (default STUDENT_ENCODER)
      The (params, batch_stats) key paths in the TrainState of the encoder the
      method's paper evaluates (DINO: the teacher's); the kNN monitor
      (evaluated_encoder) and the downstream jobs' partial restore read it there.
  recorded_config(config, checkpoint_encoder) -> config (default None)
      For a method that reads something outside its workdir at every start
      (distillation's frozen teacher): the config with what it read recorded (a file's
      digest, a checkpoint's step); the pretraining job runs with it, so a resumed
      run whose source changed stops at the resume check.
  frozen_variables(config, mesh) -> pytree (default None)
      Variables the step reads and nothing updates, out of the TrainState and so out of
      every checkpoint (distillation's teacher): make_train_step's train_step then is
      train_step(state, batch, frozen), and pretraining.setup reads them once and passes
      them to every step (arguments of the executable, not constants of its program).
  imported_state(entries, path, config) -> variables or None, with
  with_imported(state, variables) -> state (both or neither; default None)
      For a method whose reference saves checkpoints this package can continue
      (DINO's main_dino.py): imported_state reads such a checkpoint (None: not
      one; entries as tensor_files.read_entries gives them) and config.init_from
      then starts the run with with_imported in place of with_encoder.

tests/test_methods.py checks every registered method against this contract, the
optional attributes included.
"""

import dataclasses
from typing import Callable, Optional

import jax
import optax

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.methods import byol
from contrastive_jax.methods import dino
from contrastive_jax.methods import distillation
from contrastive_jax.methods import moco
from contrastive_jax.methods import mocov3
from contrastive_jax.methods import simclr

METHODS = {
  "byol": byol,
  "dino": dino,
  "distillation": distillation,
  "moco": moco,
  "mocov3": mocov3,
  "simclr": simclr,
}
ENCODER = "encoder"


def get_method(name: str):
  """The method module for config.method.

  Raises:
    ConfigError: unknown method name.
  """
  if name not in METHODS:
    raise ConfigError("method", name, f"one of {sorted(METHODS)}")
  return METHODS[name]


def encoder_variables(tree):
  """The encoder's {'params', 'batch_stats'} of a TrainState (or a dict with those keys).

  'batch_stats' is {} for an encoder without BN (a ViT), whose state has no
  batch_stats['encoder'] (a dict may then lack 'batch_stats' altogether).
  """
  get = tree.get if isinstance(tree, dict) else lambda k: getattr(tree, k)
  return {
    "params": get("params")[ENCODER],
    "batch_stats": (get("batch_stats") or {}).get(ENCODER, {}),
  }


# Where the student's encoder lives in a TrainState: (params path, batch_stats path).
STUDENT_ENCODER = (("params", ENCODER), ("batch_stats", ENCODER))


def _attribute(name: str, default):
  """A field of OptionalAttributes read from the method module's attribute `name`."""
  return dataclasses.field(default=default, metadata={"attribute": name})


@dataclasses.dataclass(frozen=True)
class OptionalAttributes:
  """A method module's optional attributes, each with the value a module without it has.

  Attributes (each read from the module attribute in brackets):
    local_crops (LOCAL_CROPS): whether the method trains on multi-crop's local views
      (config.local_crops, batch['local_image']) besides the two global views.
    evaluated_encoder (EVALUATED_ENCODER): (params path, batch_stats path), the key
      paths in the TrainState of the encoder the method's paper evaluates, which the
      kNN monitor and the downstream jobs read. STUDENT_ENCODER by default: the network
      each paper but DINO's evaluates (SimCLR's encoder, MoCo's query encoder, MoCo v3's
      base encoder, BYOL's online encoder); DINO sets its teacher's (the paper's Sec. 4,
      and eval_knn.py's and eval_linear.py's --checkpoint_key teacher).
    imported_state (imported_state): (entries, path, config) -> variables or None, the
      run's start from the method's own reference checkpoint (None: not one), or None
      for a method without such checkpoints.
    with_imported (with_imported): (state, variables) -> state, the state at step 0
      with imported_state's variables; None where imported_state is.
    recorded_config (recorded_config): (config, checkpoint_encoder) -> config, the config
      with what the run reads from outside its workdir recorded in its fields (the
      distillation teacher's file digest or checkpoint step), checkpoint_encoder(field,
      workdir, saved config) giving the pretraining config and key paths of the encoder a
      workdir's checkpoint holds (training.restore); the pretraining job runs with it,
      so a resumed run whose source changed stops at the resume check. None: nothing read.
    frozen_variables (frozen_variables): (config, mesh) -> a pytree replicated on the mesh
      that the step reads and nothing updates, kept out of the TrainState (distillation's
      teacher); the method's train_step then takes it as a third argument, which
      pretraining.setup passes. None: the step reads the state and the batch only.
  """

  local_crops: bool = _attribute("LOCAL_CROPS", False)
  evaluated_encoder: tuple = _attribute("EVALUATED_ENCODER", STUDENT_ENCODER)
  imported_state: Optional[Callable] = _attribute("imported_state", None)
  with_imported: Optional[Callable] = _attribute("with_imported", None)
  recorded_config: Optional[Callable] = _attribute("recorded_config", None)
  frozen_variables: Optional[Callable] = _attribute("frozen_variables", None)


def optional_attributes(name: str) -> OptionalAttributes:
  """Method `name`'s OptionalAttributes: its module's, and the defaults for those it lacks.

  Raises:
    ConfigError: unknown method name.
  """
  module = get_method(name)
  return OptionalAttributes(
    **{
      field.name: getattr(module, field.metadata["attribute"], field.default)
      for field in dataclasses.fields(OptionalAttributes)
    }
  )


def evaluated_encoder(name: str):
  """state -> {'params', 'batch_stats'} of the encoder at
  optional_attributes(name).evaluated_encoder; 'batch_stats' {} where the state has none
  (a ViT). The online probe is trained on, and evaluated with, the student's h
  (encoder_variables), whatever the method.

  Raises:
    ConfigError: unknown method name.
    KeyError (from the function, on a state): no params at the method's path.
  """
  params_path, stats_path = optional_attributes(name).evaluated_encoder

  def at(state, path, required: bool):
    node = state
    for key in path:
      node = node.get(key) if isinstance(node, dict) else getattr(node, key, None)
      if node is None:
        if required:
          raise KeyError(f"method {name!r}: no {'.'.join(path)} in its state")
        return {}
    return node

  return lambda state: {
    "params": at(state, params_path, True),
    "batch_stats": at(state, stats_path, False),
  }


def with_encoder(state, variables):
  """state with every copy of the encoder replaced by variables ({'params', 'batch_stats'}).

  The copies are state.params['encoder'], state.batch_stats['encoder'] and,
  in state.extra, every dict's 'encoder' entry shaped like either (MoCo's key
  encoder, MoCo v3's momentum encoder, BYOL's target network): a run that
  starts from imported weights starts all of its networks from them, as the
  references copy the online encoder into the others at step 0.

  Raises:
    ValueError: variables not shaped like the state's encoder.
  """
  params, stats = variables["params"], variables.get("batch_stats") or {}
  shapes = {
    name: jax.tree.structure(tree) for name, tree in (("params", params), ("batch_stats", stats))
  }
  if jax.tree.structure(state.params[ENCODER]) != shapes["params"]:
    raise ValueError("the variables are not shaped like the state's encoder")

  def replace(tree):
    if not isinstance(tree, dict):
      return tree
    out = {k: replace(v) for k, v in tree.items()}
    if ENCODER in tree:
      structure = jax.tree.structure(tree[ENCODER])
      out[ENCODER] = (
        params
        if structure == shapes["params"]
        else (stats if structure == shapes["batch_stats"] else out[ENCODER])
      )
    return out

  batch_stats = dict(state.batch_stats)
  if ENCODER in batch_stats:
    batch_stats[ENCODER] = stats
  return state.replace(
    params=dict(state.params, **{ENCODER: params}),
    batch_stats=batch_stats,
    extra=replace(state.extra),
  )


def run_keys(seed: int):
  """(init_rng, rng) of a pretraining run: the key its parameters are drawn with and
  the base key of every later draw (TrainState.rng), both from PRNGKey(seed)."""
  return tuple(jax.random.split(jax.random.PRNGKey(seed)))


def initial_variables(config, submodule: str = ENCODER):
  """The student's `submodule` ('encoder', or 'projector': the projection head)
  {'params', 'batch_stats'} at step 0 of the pretraining run `config` describes, drawn
  exactly as that run drew them; builds no optimizer or train step. 'batch_stats' is {}
  for a submodule without BN.

  The baseline of the downstream jobs (config.random_init). Call it under jax.jit.

  Raises:
    ConfigError: unknown method name.
  """
  method = get_method(config.method)
  init_rng, rng = run_keys(config.seed)
  # The optimizer state is dropped: any optimizer gives the same parameters.
  state = method.init_state(config, method.build_model(config), optax.identity(), init_rng, rng)
  return {
    "params": state.params[submodule],
    "batch_stats": (state.batch_stats or {}).get(submodule, {}),
  }
