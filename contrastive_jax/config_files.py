"""Config files and the saved-config format: what every job reads its config with.

parse_args reads a config file's FILE:ARG argument (every file in configs/ calls
it first), load_config_file runs a config file's get_config(ARG), and
upgrade_config reads a config saved with a checkpoint (or recorded by an export)
in any older format as this code writes it (FORMAT_VERSION): the one place
that says what an older file lacking a field meant, so that the builders read
plain fields.
"""

import importlib.machinery
import importlib.util
import os
import re
from typing import Optional

import ml_collections

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core.errors import VariantError
from contrastive_jax.core.errors import closest
from contrastive_jax.models import resnet


def parse_args(arg: str, args: dict, variants: Optional[dict] = None) -> ml_collections.ConfigDict:
  """The arguments of a config file's get_config(arg), given as --config=FILE:ARG.

  arg is a comma-separated list of items, applied left to right (a later item
  wins): 'key=value', value one of args[key] as written by str(); a bare 'key'
  for a flag (key=True and key=False also parse); or the name of a variant,
  which stands for its items (variants[name], e.g. 'runlocal,model=vit_tiny'),
  so 'runlocal_vit,dtype=bfloat16' combines them. Every file in configs/
  declares what it takes in a module-level ARGS (and VARIANTS, if it has any)
  and calls this first in get_config(arg), so that a misspelled FILE:ARG ends
  in one line naming what the file takes and the closest valid name (main.py).

  Args:
    arg: as given after the colon; '' for the defaults.
    args: name -> False for a flag (off unless given), or a tuple of the allowed
      values (str or int), the default first.
    variants: name -> the items it stands for.

  Returns:
    name -> value for every name of args.

  Raises:
    VariantError: a bare word that is neither a flag nor a variant, a name
      args lacks, a value args[key] does not allow.
  """
  variants = variants or {}
  choices = {key: (False, True) if spec is False else tuple(spec) for key, spec in args.items()}
  values = {key: allowed[0] for key, allowed in choices.items()}
  listed = _listed(args, variants)
  items = []
  for item in filter(None, map(str.strip, arg.split(","))):
    items += variants[item].split(",") if item in variants else [item]
  for item in items:
    key, has_value, value = item.partition("=")
    key, value = key.strip(), value.strip()
    if not has_value:
      if args.get(key) is False:
        values[key] = True
        continue
      if key in args:
        raise VariantError(
          f"argument {key!r} needs a value, one of "
          f"{', '.join(map(str, choices[key]))} (e.g. {key}={choices[key][0]})",
          key,
          (),
        )
      raise VariantError(
        f"no argument or variant {key!r} ({listed})",
        key,
        [
          *(k for k in args if args[k] is False),
          *variants,
          *(f"{k}={v}" for k in args if args[k] is not False for v in choices[k]),
        ],
      )
    if key not in args:
      raise VariantError(f"no argument {key!r} ({listed})", key, args)
    named = {str(allowed): allowed for allowed in choices[key]}
    if value not in named:
      raise VariantError(
        f"no value {value!r} of argument {key!r} (its values: {', '.join(named)})", value, named
      )
    values[key] = named[value]
  return ml_collections.ConfigDict(values)


def _listed(args: dict, variants: dict) -> str:
  """What a config file takes, in words: 'the config's arguments: runlocal,
  dtype=float32|bfloat16; variants: runlocal_vit (runlocal,model=vit_tiny)'."""
  if not args and not variants:
    return "the config takes none"
  listed = "the config's arguments: " + ", ".join(
    key if spec is False else f"{key}={'|'.join(map(str, spec))}" for key, spec in args.items()
  )
  if variants:
    listed += "; variants: " + ", ".join(f"{name} ({items})" for name, items in variants.items())
  return listed


# The format of the configs this code writes with each checkpoint (config.format_version),
# and of the pretraining config an export records: upgrade_config reads every older one.
FORMAT_VERSION = 1


def upgrade_config(saved: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of a saved job config in the format this code writes (FORMAT_VERSION).

  Call it on every config read back from a file: a checkpoint's
  (checkpointing.Checkpointer.saved_config) and the pretraining config an export
  recorded. Format 0 (no format_version field) holds the host crop in three
  flat fields crop_sampler, crop_area_min and crop_resize; format 1 holds them
  in config.crop (recipes.crop()). A field that configs of either format written
  before it existed lack takes the value that gives what they trained:
  - a pretraining config without on_device_data read its data on the host: False;
    a DINO one without dino.drop_path_rate trained without stochastic depth: 0;
    a projector or predictor without init: 'lecun_normal' (flax's default);
  - a fine-tuning config without backbone_lr_multiplier and layer_decay trained every
    layer at one rate: 1 and 1; one without projector_layers fine-tuned from h: 0;
  - a label-efficiency config without linear_probe.lr_grid or finetune.lr_grid fitted the
    base rate alone: '1'; one without finetune.projector_layers fine-tuned from h: 0; one
    whose weights (and weights_config) is a bare value, not named entries (named_entries),
    read one file as the init 'weights': 'weights=VALUE';
  - a model without input_mean and input_std took its [0, 1] inputs as they were:
    (0, 0, 0) and (1, 1, 1); a ResNet without zero_init_residual, conv_init, padding
    and stage_projection: True, 'he_normal', 'legacy' (resnet.PADDINGS) and False.

  Raises:
    ConfigError: a format_version above FORMAT_VERSION (written by a newer version of
      this project).
  """
  fields = saved.to_dict()
  version = fields.get("format_version", 0)
  if version > FORMAT_VERSION:
    raise ConfigError(
      "format_version",
      version,
      f"at most {FORMAT_VERSION}: the config was written by a newer version of contrastive_jax",
    )
  if version < 1:
    flat = {
      key: fields.pop(f"crop_{key}")
      for key in ("sampler", "area_min", "resize")
      if f"crop_{key}" in fields
    }
    if flat:
      fields["crop"] = flat
  if fields.get("job", "pretrain") == "pretrain":
    fields.setdefault("on_device_data", False)  # Older pretraining configs read on the host.
    if "dino" in fields:  # Older DINO configs trained without stochastic depth.
      fields["dino"].setdefault("drop_path_rate", 0.0)
    for head in ("projector", "predictor"):  # Older heads were initialised as flax's Dense.
      if isinstance(fields.get(head), dict):
        fields[head].setdefault("init", "lecun_normal")
  if fields.get("job") == "finetune":  # Older fine-tuning configs trained at one rate.
    fields.setdefault("backbone_lr_multiplier", 1.0)
    fields.setdefault("layer_decay", 1.0)
    fields.setdefault("projector_layers", 0)
  if fields.get("job") == "label_efficiency":  # Older ones fitted the base rate alone, from h.
    for part in ("linear_probe", "finetune"):
      fields.get(part, {}).setdefault("lr_grid", "1")
    fields.get("finetune", {}).setdefault("projector_layers", 0)
    for field in ("weights", "weights_config"):  # Older ones held one file, the init 'weights'.
      value = fields.get(field)
      if value and not _NAMED.match(value.strip()):
        fields[field] = f"weights={value}"
  if isinstance(fields.get("model"), dict):
    _upgrade_model(fields["model"])
  fields["format_version"] = FORMAT_VERSION
  return ml_collections.ConfigDict(fields)


# A label-efficiency init's name, and an entry 'NAME=VALUE' of its weights fields: a name
# holds no '/', ':' or '.', so that a bare path or configs/X.py:ARG=V is never read as named.
_INIT_NAME = r"[A-Za-z][A-Za-z0-9_-]*"
_NAMED = re.compile(rf"({_INIT_NAME})=(.*)", re.DOTALL)


def is_init_name(name: str) -> bool:
  """Whether name can name a label-efficiency init: letters, digits, _ and -, a letter first."""
  return re.fullmatch(_INIT_NAME, name) is not None


def named_entries(value) -> dict:
  """{name: value} of a field of entries 'NAME=VALUE' separated by ';' (the label-efficiency
  job's weights and weights_config), in their order; None or '' gives {}.

  Raises:
    ValueError: an entry that is not NAME=VALUE with a non-empty value, or a name given twice.
  """
  entries = {}
  for entry in filter(None, (e.strip() for e in (value or "").split(";"))):
    match = _NAMED.fullmatch(entry)
    if not match or not match.group(2).strip():
      raise ValueError(f"{entry!r} is not NAME=VALUE")
    name = match.group(1)
    if name in entries:
      raise ValueError(f"{name!r} is given twice")
    entries[name] = match.group(2).strip()
  return entries


def _upgrade_model(model: dict):
  """Sets the fields a saved model config (upgrade_config's fields['model']) lacks in place."""
  model.setdefault("input_mean", (0.0, 0.0, 0.0))  # Inputs in [0, 1], unstandardised.
  model.setdefault("input_std", (1.0, 1.0, 1.0))
  if model.get("name") in resnet.SPECS:  # The ResNet older checkpoints trained.
    model.setdefault("zero_init_residual", True)
    model.setdefault("conv_init", "he_normal")
    model.setdefault("padding", "legacy")
    model.setdefault("stage_projection", False)


def load_config_file(value: str, flag: str) -> ml_collections.ConfigDict:
  """get_config(ARG) of a config FILE[:ARG], as ml_collections calls it for --config.

  flag names where value was given (e.g. '--config', 'config.pretrain_config') in the errors.

  Raises:
    JobError: no such file (naming the closest in its folder), not a config file, or
      an argument it does not take (parse_args).
  """
  path, *arg = value.split(":", 1)
  if not os.path.isfile(path):
    folder = os.path.dirname(path)
    names = (
      [n for n in os.listdir(folder or ".") if n.endswith(".py")]
      if os.path.isdir(folder or ".")
      else []
    )
    guess = closest(os.path.basename(path), names)
    hint = (
      f"; did you mean {os.path.join(folder, guess)!r}?"
      if guess
      else f" (the config files in {folder or '.'}: {', '.join(sorted(names))})"
      if names
      else ""
    )
    raise JobError(f"{flag}={value}: no such file{hint}")
  loader = importlib.machinery.SourceFileLoader("contrastive_jax_checked_config", path)
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
  try:
    loader.exec_module(module)
  except SyntaxError as e:
    raise JobError(
      f"{flag}={value}: not a config file: Python cannot read it ({e.msg}, line {e.lineno})"
    ) from None
  if not callable(getattr(module, "get_config", None)):
    raise JobError(f"{flag}={value}: not a config file: it defines no get_config(arg)")
  try:
    return module.get_config(*arg)
  except VariantError as e:
    raise JobError(f"{flag}={value}: {e}") from None
