"""Building blocks of the configs in configs/: shared defaults, recipes, probe presets.

The view, crop, model and optimizer blocks below each reproduce one
reference's recipe; the docstrings name the reference and the code there.
"""

import importlib.machinery
import importlib.util
import os
from typing import Optional

import ml_collections
from ml_collections import config_dict

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core.errors import VariantError
from contrastive_jax.core.errors import closest
from contrastive_jax.models import vit


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
    in config.crop (crop()). A pretraining config without on_device_data (written
    before the field existed) read its data on the host: False; a DINO one without
  dino.drop_path_rate trained without stochastic depth: 0. A fine-tuning config without
    backbone_lr_multiplier and layer_decay trained every layer at one rate: 1 and 1; one
    without projector_layers fine-tuned from h: 0; a label-efficiency config without
    linear_probe.lr_grid or finetune.lr_grid fitted the base rate alone: '1', one without
    finetune.projector_layers fine-tuned from h: 0.

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
  if fields.get("job") == "finetune":  # Older fine-tuning configs trained at one rate.
    fields.setdefault("backbone_lr_multiplier", 1.0)
    fields.setdefault("layer_decay", 1.0)
    fields.setdefault("projector_layers", 0)
  if fields.get("job") == "label_efficiency":  # Older ones fitted the base rate alone, from h.
    for part in ("linear_probe", "finetune"):
      fields.get(part, {}).setdefault("lr_grid", "1")
    fields.get("finetune", {}).setdefault("projector_layers", 0)
  fields["format_version"] = FORMAT_VERSION
  return ml_collections.ConfigDict(fields)


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


def simclr_view(strength: float, blur_prob: float, brightness_op: str = "add") -> dict:
  """SimCLR's on-device view (Appendix A; data_util.preprocess_for_train, batch_random_blur).

  Color jitter of strength s (brightness, contrast, saturation 0.8 s, hue
  0.2 s) in random order with p 0.8, tf.image ops; grayscale p 0.2 after it;
  blur with p blur_prob, zero-padded. brightness_op 'add' is v1's
  tf.image.random_brightness (the code behind the v1 paper and README numbers),
  'multiply' the tf2 code's (SimCLR v2).
  """
  return dict(
    brightness=0.8 * strength,
    contrast=0.8 * strength,
    saturation=0.8 * strength,
    hue=0.2 * strength,
    color_jitter_prob=0.8,
    grayscale_prob=0.2,
    blur_prob=blur_prob,
    color_ops="tensorflow",
    brightness_op=brightness_op,
    blur_padding="zeros",
  )


def data_fields(config):
  """Sets the fields every job reads its data with (CIFAR-10 from TFDS by default)."""
  config.seed = 0
  config.data_source = "tfds"
  config.dataset = "cifar10"
  config.data_dir = config_dict.placeholder(str)  # None: TFDS_DATA_DIR or ~/tensorflow_datasets.
  config.train_split = "train"
  # Keep decoded images in host memory (small datasets only), and shuffle
  # through a buffer of shuffle_buffer images: for training, TFRecord datasets
  # only (streamed in file order); ArrayRecord ones are read by index in a
  # full permutation every epoch (input_pipeline.py). Evaluation caches either.
  config.cache = True
  config.shuffle_buffer = 50_000
  config.data_threads = 2
  return config


def pretrained_encoder_fields(config):
  """Sets the fields that say which encoder a downstream job starts from (jobs/downstream.py)."""
  # The pretraining job's --workdir, or a weights file (.safetensors; .pth with torch) of a
  # torchvision ResNet or timm / MoCo v3 ViT, whose model pretrain_config then describes.
  config.pretrain_workdir = config_dict.placeholder(str)
  config.pretrain_config = config_dict.placeholder(str)  # configs/X.py[:ARG,...], for a file.
  config.pretrain_step = -1  # -1: the latest checkpoint.
  config.random_init = False  # True: the pretraining run's encoder at initialisation (baseline).
  config.model_name = config_dict.placeholder(str)  # If set, the checkpoint's model must match.
  return config


def base_config() -> ml_collections.ConfigDict:
  """Pretraining defaults: data, durations, checkpoints and the evaluators.

  Durations ('duration', 'log_every', 'checkpoint_every', each evaluator's
  'every') are strings 'N steps' or 'N epochs', resolved when the job knows
  its dataset size and global batch (to_steps).
  """
  config = data_fields(ml_collections.ConfigDict())
  config.job = "pretrain"
  config.format_version = FORMAT_VERSION
  config.image_size = 32
  config.eval_crop_fraction = 1.0
  config.duration = "100 epochs"
  config.log_every = "100 steps"
  config.checkpoint_every = "1000 steps"
  config.keep_checkpoints = 3
  # Each evaluator also runs at the last step; the kNN monitor at step 0 too.
  config.evaluators = dict(
    knn=dict(
      kind="knn",
      every="10 epochs",
      split="test",
      bank_split="train",
      k=200,
      temperature=0.1,
      batch_size=1000,
    ),
    online_probe=dict(kind="classifier", every="10 epochs", split="test", batch_size=1000),
  )
  config.online_probe = dict(learning_rate=1e-3)
  # Hold the train split in device memory and crop and flip on the device
  # (data/device_data.py): for small datasets of equal-size images (CIFAR). The
  # evaluators still read through the host pipeline.
  config.on_device_data = False
  # A weights file (.safetensors; .pth with torch) of a torchvision ResNet or a timm /
  # MoCo v3 ViT that every network starts from (jobs/pretrain.py, docs/weights.md).
  config.init_from = config_dict.placeholder(str)
  return config


def moco_v1_view() -> dict:
  """MoCo v1's views (main_moco.py without --aug-plus): grayscale p 0.2, then
  torchvision's ColorJitter(0.4, 0.4, 0.4, 0.4) always."""
  return dict(
    brightness=0.4,
    contrast=0.4,
    saturation=0.4,
    hue=0.4,
    color_jitter_prob=1.0,
    grayscale_prob=0.2,
    grayscale_first=True,
    color_ops="torchvision",
    brightness_op="multiply",
  )


def moco_v2_view(blur_prob: float) -> dict:
  """MoCo v2's views (main_moco.py --aug-plus): torchvision's ColorJitter(0.4, 0.4, 0.4,
  0.1) p 0.8, grayscale p 0.2, PIL Gaussian blur (edges repeated) with p blur_prob."""
  return dict(
    brightness=0.4,
    contrast=0.4,
    saturation=0.4,
    hue=0.1,
    color_jitter_prob=0.8,
    grayscale_prob=0.2,
    blur_prob=blur_prob,
    color_ops="torchvision",
    brightness_op="multiply",
    blur_padding="edge",
  )


def byol_views(
  color_ops: str = "tensorflow", brightness_op: str = "add", blur: bool = True
) -> dict:
  """BYOL's asymmetric views (Grill et al. 2020, Table 6; byol/utils/augmentations.py).

  Jitter (0.4, 0.4, 0.2, 0.1) p 0.8 and grayscale p 0.2 on both; view 1
  blurred with p 1.0, never solarized; view 2 blurred with p 0.1 and
  solarized with p 0.2. BYOL's own ops are tf.image's with additive
  brightness and zero-padded blur; solo-learn's CIFAR-10 recipe
  (augmentations/asymmetric.yaml) uses torchvision's ColorJitter and no blur
  (blur=False).
  """
  jitter = dict(
    brightness=0.4,
    contrast=0.4,
    saturation=0.2,
    hue=0.1,
    color_jitter_prob=0.8,
    grayscale_prob=0.2,
    color_ops=color_ops,
    brightness_op=brightness_op,
    blur_padding="zeros",
  )
  return dict(
    view1=dict(jitter, blur_prob=1.0 if blur else 0.0, solarize_prob=0.0),
    view2=dict(jitter, blur_prob=0.1 if blur else 0.0, solarize_prob=0.2),
  )


def mocov3_views() -> dict:
  """MoCo v3's views (moco-v3 main_moco.py, "BYOL's augmentation recipe"):
  BYOL's asymmetric jitter, grayscale, blur (p 1.0 / 0.1) and solarization (p 0 / 0.2),
  with torchvision's ColorJitter and PIL's Gaussian blur (edges repeated)."""
  views = byol_views("torchvision", "multiply")
  for view in views.values():
    view["blur_padding"] = "edge"
  return views


def dino(**overrides) -> dict:
  """config.dino at main_dino.py's argparse defaults (facebookresearch/dino), overrides applied:
  head of 65536 outputs (hidden 2048, bottleneck 256, 3 layers, no BN, weight-normalised last
  layer), teacher momentum 0.996 -> 1, student temperature 0.1, teacher temperature 0.04
  without warm-up, centre momentum 0.9, stochastic depth 0.1 in a ViT student."""
  return dict(
    dict(
      out_dim=65536,
      hidden_dim=2048,
      bottleneck_dim=256,
      num_layers=3,
      use_bn_in_head=False,
      norm_last_layer=True,
      momentum_teacher=0.996,
      student_temp=0.1,
      warmup_teacher_temp=0.04,
      teacher_temp=0.04,
      warmup_teacher_temp_epochs=0,
      center_momentum=0.9,
      drop_path_rate=0.1,
    ),
    **overrides,
  )


def dino_optimizer(name: str, base_lr: float, weight_decay: float, weight_decay_end) -> dict:
  """DINO's optimizer (main_dino.py): `name` ('adamw' or 'sgd', momentum 0.9) at base_lr x
  B/256 after 10 linear warm-up epochs, cosine to --min_lr 1e-6; weight decay from
  weight_decay to weight_decay_end by a cosine (None: constant), on kernels only
  (get_params_groups: none on biases and norms); each gradient tensor clipped at norm
  --clip_grad 3.0; the last layer held for --freeze_last_layer 1 epoch."""
  return optimizer(
    name,
    base_lr=base_lr,
    weight_decay=weight_decay,
    weight_decay_end=weight_decay_end,
    final_lr=1e-6,
    clip_per_tensor=3.0,
    freeze_last_layer_epochs=1.0,
  )


def dino_multi_crop(config, *, number: int, size: int, global_scale: float, local_scale):
  """Multi-crop as DINO's DataAugmentationDINO: the global views' crop area from global_scale
  to 1, `number` local views of `size` pixels at area local_scale = (min, max), each as
  the global views' view 1 (flip, jitter, grayscale) but blurred with p 0.5 and never
  solarised. Sets config.crop.area_min, config.local_crops and config.augment.local."""
  config.crop.area_min = global_scale
  config.local_crops = dict(
    number=number, size=size, area_min=local_scale[0], area_max=local_scale[1]
  )
  config.augment.local = dict(config.augment.view1, blur_prob=0.5)
  return config


def crop(sampler: str, area_min: float, resize: str) -> dict:
  """config.crop, the training views' random resized crop (crop_spec.CropSpec): a crop_spec.SAMPLERS
  sampler, the smallest crop area as a fraction of the image, a crop_spec.RESIZES resize (the
  evaluation's centre crop resizes with it too)."""
  return dict(sampler=sampler, area_min=area_min, resize=resize)


# ImageNet channel statistics (torchvision's Normalize in MoCo; BYOL's normalize_images).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def model(name: str, stem: str, dtype: str, reference: str) -> dict:
  """A model config with the reference's initialisation and input scaling.

  reference 'simclr': variance-scaling (TF) convs, zero-initialised last BN
  scale of each block, inputs in [0, 1], SimCLR's TF padding and a projection
  shortcut in every stage's first block; 'byol': the same (Haiku's defaults,
  BYOL's zero-init and projections) with ImageNet standardisation and Haiku's
  'SAME' padding; 'torchvision': He-normal fan-out convs, last BN scale 1,
  ImageNet standardisation, torchvision's symmetric padding and shortcuts
  projected only where the shape changes (MoCo).
  (resnet.PADDINGS says where each pads.) CIFAR-10 recipes replace
  input_mean/input_std with their own statistics.
  """
  imagenet = dict(input_mean=IMAGENET_MEAN, input_std=IMAGENET_STD)
  fields = {
    "simclr": dict(
      zero_init_residual=True,
      conv_init="variance_scaling",
      padding="tensorflow",
      stage_projection=True,
      input_mean=(0.0, 0.0, 0.0),
      input_std=(1.0, 1.0, 1.0),
    ),
    "byol": dict(
      zero_init_residual=True,
      conv_init="variance_scaling",
      padding="same",
      stage_projection=True,
      **imagenet,
    ),
    "torchvision": dict(
      zero_init_residual=False,
      conv_init="he_normal",
      padding="torchvision",
      stage_projection=False,
      **imagenet,
    ),
  }
  return dict(name=name, width=1.0, stem=stem, dtype=dtype, **fields[reference])


def vit_model(name: str, patch_size: int, dtype: str, random_patch_projection: bool) -> dict:
  """A ViT model config (a vit.SPECS name) at the spec's width (multiplier
  1) and depth, ImageNet standardisation as MoCo v3's inputs."""
  return dict(
    name=name,
    width=1.0,
    depth=vit.SPECS[name][1],
    patch_size=patch_size,
    dtype=dtype,
    random_patch_projection=random_patch_projection,
    input_mean=IMAGENET_MEAN,
    input_std=IMAGENET_STD,
  )


def runlocal(config):
  """Shrinks a CIFAR-10 config to 4 to 6 minutes on a 2-core CPU (the ResNets of SimCLR, MoCo
  and BYOL, docs/results.md), same code path.

  Narrow ResNet-18 (width 0.25: 16 to 128 channels) with the ImageNet stem,
  whose stride 4 makes the step ~8x cheaper on 32x32 images than the CIFAR
  stem (the difference between ~3 and ~8 epochs in the time); batch 256,
  1500 steps (~7.7 epochs), evaluators every 500 steps.
  """
  config.batch_size = 256
  config.duration = "1500 steps"
  config.model.width = 0.25
  config.model.stem = "imagenet"
  config.optimizer.warmup_epochs = 1.0
  config.log_every = "20 steps"
  config.checkpoint_every = "200 steps"
  for evaluator in config.evaluators.values():
    evaluator.every = "500 steps"
  return config


def optimizer(name: str, base_lr: float, weight_decay: float, **overrides) -> dict:
  """An optimizer config (methods/optim.py): warm-up then cosine by default, linear lr scaling.

  schedule 'step' multiplies the lr by decay_factor at each of decay_epochs;
  weight_decay_mask, lr_before_momentum and nesterov choose the reference's
  variant (methods/optim.py docstring). Rates, factors and epochs are floats whatever the
  caller wrote (warmup_epochs=0 is 0.0): a ConfigDict field keeps the type of its first value,
  and --config.optimizer.warmup_epochs=0.5 must parse in every config.
  """
  config = dict(
    name=name,
    base_lr=base_lr,
    lr_scaling="linear",
    weight_decay=weight_decay,
    weight_decay_mask="kernels",
    momentum=0.9,
    nesterov=False,
    lr_before_momentum=False,
    trust_coefficient=0.001,
    warmup_epochs=10.0,
    schedule="cosine",
    decay_epochs=(),
    decay_factor=0.1,
  )
  config.update(overrides)
  for key in (
    "base_lr",
    "weight_decay",
    "momentum",
    "trust_coefficient",
    "warmup_epochs",
    "decay_factor",
  ):
    config[key] = float(config[key])
  config["decay_epochs"] = tuple(float(epoch) for epoch in config["decay_epochs"])
  return config


def imagenet(config, *, batch_size: int, num_epochs: int, reference: str):
  """Sets ImageNet (TFDS imagenet2012, 224 px) data fields and a ResNet-50 in bfloat16
  initialised as `reference`'s (see model()).

  The kNN bank is 10% of train (128k x 2048 floats, 1 GB over the devices);
  the evaluators run every 10 epochs on the validation split.
  """
  config.dataset = "imagenet2012"
  config.image_size = 224
  config.eval_crop_fraction = 0.875
  config.cache = False
  config.data_threads = 32
  config.batch_size = batch_size
  config.duration = f"{num_epochs} epochs"
  config.model = model("resnet50", "imagenet", "bfloat16", reference)
  config.checkpoint_every = "2000 steps"
  for evaluator in config.evaluators.values():
    evaluator.split = "validation"
    evaluator.batch_size = 1024
  config.evaluators.knn.bank_split = "train[:10%]"
  return config


# Linear-probe presets (configs/linear_probe.py): each reference's own linear
# evaluation, with the figures it gives for CIFAR-10 where it has them. Every
# preset keeps the encoder frozen in eval mode, as all three references do
# (SimCLR's model_fn: "Finetune just supervised (linear) head will not update
# BN stats"), and trains on random crops and flips without color changes.
LINEAR_PROBE_PRESETS = {
  # SimCLR README, CIFAR-10 fine-tuning of the linear head (run.py
  # --train_mode=finetune --fine_tune_after_block=4): momentum optimizer
  # (tf.train.MomentumOptimizer, Nesterov), lr 0.1 x B/256, no weight decay
  # (1e-6 on ImageNet), batch 512, 100 epochs (90 on ImageNet), cosine, no
  # warm-up, logits layer zero-initialised.
  "simclr": dict(
    batch_size=512,
    duration="100 epochs",
    crop=crop("tensorflow", 0.08, "tf_bicubic"),
    head=dict(standardize=False, init="zeros"),
    optimizer=optimizer("sgd", 0.1, 0.0, nesterov=True, warmup_epochs=0, weight_decay_mask="all"),
  ),
  # MoCo main_lincls.py (and its CIFAR-10 demo's advice: lr 30, wd 0, 100
  # epochs): SGD momentum 0.9, lr 30 at batch 256, no weight decay, lr x0.1
  # at epochs 60 and 80, RandomResizedCrop(scale 0.08-1) and flip, fc weights
  # normal(0, 0.01), bias 0. The decays as fractions of the run (0.6, 0.8): the
  # same epochs at its 100, and a shorter run (runlocal's) decays too.
  "moco": dict(
    batch_size=256,
    duration="100 epochs",
    crop=crop("torchvision", 0.08, "pil_bilinear"),
    head=dict(standardize=False, init="normal_0.01"),
    optimizer=optimizer(
      "sgd",
      30.0,
      0.0,
      warmup_epochs=0,
      schedule="step",
      decay_fractions=(0.6, 0.8),
      weight_decay_mask="all",
    ),
  ),
  # BYOL configs/eval.py and eval_experiment.py: SGD with Nesterov momentum
  # 0.9, base lr 0.2 x B/256, cosine, no warm-up, no weight decay, 80
  # epochs, batch 1024 (the paper's), BYOL's own crop and a flip, hk.Linear's
  # default initialisation.
  "byol": dict(
    batch_size=1024,
    duration="80 epochs",
    crop=crop("byol", 0.08, "tf_bicubic"),
    head=dict(standardize=False, init="lecun_normal"),
    optimizer=optimizer("sgd", 0.2, 0.0, nesterov=True, warmup_epochs=0, weight_decay_mask="all"),
  ),
  # MoCo v3 main_lincls.py: SGD momentum 0.9, lr 0.1 x B/256 (its default, the
  # ResNet-50 command; CONFIG.md's ViT commands pass --lr=3), no weight decay,
  # batch 1024, 90 epochs, half-cycle cosine without warm-up, RandomResizedCrop
  # (scale 0.08-1) and flip, fc weights normal(0, 0.01), bias 0.
  "mocov3": dict(
    batch_size=1024,
    duration="90 epochs",
    crop=crop("torchvision", 0.08, "pil_bilinear"),
    head=dict(standardize=False, init="normal_0.01"),
    optimizer=optimizer("sgd", 0.1, 0.0, warmup_epochs=0, weight_decay_mask="all"),
  ),
  # DINO eval_linear.py as its README runs it (8 GPUs x --batch_size_per_gpu 128): SGD
  # momentum 0.9, lr 0.001 x B/256, no weight decay, batch 1024, 100 epochs, cosine to 0
  # without warm-up (CosineAnnealingLR), RandomResizedCrop(224) (scale 0.08-1, bilinear)
  # and flip, fc weights normal(0, 0.01), bias 0. (Its ViTs' probe reads the class tokens
  # of the last 4 blocks; this preset reads h, the last one.)
  "dino": dict(
    batch_size=1024,
    duration="100 epochs",
    crop=crop("torchvision", 0.08, "pil_bilinear"),
    head=dict(standardize=False, init="normal_0.01"),
    optimizer=optimizer("sgd", 0.001, 0.0, warmup_epochs=0, weight_decay_mask="all"),
  ),
  # This project's own probe, no reference's: h standardised by an
  # affine-free BN (a fixed per-feature affine map, so the classifier stays
  # linear), so that one learning rate fits every encoder, a random one too;
  # SGD momentum 0.9, lr 0.1 x B/256, cosine, no weight decay, crop 0.2-1.
  "standardised": dict(
    batch_size=256,
    duration="100 epochs",
    crop=crop("torchvision", 0.2, "pil_bilinear"),
    head=dict(standardize=True, init="zeros"),
    optimizer=optimizer("sgd", 0.1, 0.0, warmup_epochs=0),
  ),
}


def fill_probe_preset(config, name: str) -> ml_collections.ConfigDict:
  """A copy of a probe config whose unset (None) preset fields take preset `name`'s values.

  The preset fields are batch_size, duration, crop.*, head.* and optimizer.*;
  a value set in the config (e.g. by a --config flag or a config argument such
  as runlocal) wins over the preset's.
  """
  config = config.copy_and_resolve_references()
  preset = LINEAR_PROBE_PRESETS[name]
  flat = {
    "batch_size": preset["batch_size"],
    "duration": preset["duration"],
    **{f"crop.{k}": v for k, v in preset["crop"].items()},
    **{f"head.{k}": v for k, v in preset["head"].items()},
    **{f"optimizer.{k}": v for k, v in preset["optimizer"].items()},
  }
  # A preset's step decays as fractions of the run give way to decay epochs the config set
  # (the two are one choice: methods/optim.py refuses both).
  if config.optimizer.get("decay_epochs") is not None:
    flat.pop("optimizer.decay_fractions", None)
  for path, value in flat.items():
    *parents, leaf = path.split(".")
    node = config
    for parent in parents:
      node = node[parent]
    if node[leaf] is None:
      node[leaf] = value
  return config


def images(config, *, batch_size: int, num_epochs: int, reference: str):
  """Sets an image folder prepared by the prepare job as the data: 224 px, a ResNet-18
  initialised as `reference`'s (see model()).

  Name the folder's dataset with --config.dataset=NAME --config.data_dir=DIR
  (the default 'clothing' is docs/images.md's example); --config.image_size from
  64 to 224 suits the ImageNet stem. The kNN monitor votes with k = 20: the
  bank is a folder's train split, thousands of images rather than ImageNet's
  1.28 M, and 200 neighbours would be a large share of a small class. A
  dataset without labels takes no evaluators (--config.evaluators='{}').
  """
  config.dataset = "clothing"
  config.image_size = 224
  config.eval_crop_fraction = 0.875
  config.cache = False  # A folder may hold millions of photos; runlocal caches.
  config.shuffle_buffer = 10_000
  config.batch_size = batch_size
  config.duration = f"{num_epochs} epochs"
  config.model = model("resnet18", "imagenet", "float32", reference)
  config.evaluators.knn.k = 20
  return config


def runlocal_images(config, *, steps: int):
  """Shrinks an image-folder config for a 2-core CPU, same code path.

  64 px crops, ResNet-18 at width 0.25 (16 to 128 channels), batch 128,
  decoded images cached in memory, `steps` steps, evaluators every
  steps / 4. Sized for about 10 minutes of a 2-core CPU.
  """
  config.image_size = 64
  config.batch_size = 128
  config.duration = f"{steps} steps"
  config.model.width = 0.25
  config.cache = True
  config.optimizer.warmup_epochs = 1.0
  config.log_every = "10 steps"
  config.checkpoint_every = f"{steps // 4} steps"
  for evaluator in config.evaluators.values():
    evaluator.every = f"{steps // 4} steps"
    evaluator.batch_size = 256
  return config
