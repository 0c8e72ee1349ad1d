"""Building blocks of the configs in configs/: shared defaults, presets, durations."""
import re

import ml_collections
from ml_collections import config_dict

from contrastive_jax.errors import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(steps?|epochs?)\s*$")


def _parse_duration(value, field: str):
  """(N, 'steps' or 'epochs') of a duration string; ConfigError unless N > 0 (whole for steps)."""
  match = _DURATION.match(str(value))
  number = float(match.group(1)) if match else 0.0
  unit = "steps" if match and match.group(2).startswith("step") else "epochs"
  if not match or number <= 0 or (unit == "steps" and number != int(number)):
    raise ConfigError(field, value,
                      "a duration 'N steps' or 'N epochs' with N > 0 (steps a whole number)")
  return number, unit


def check_duration(value, field: str):
  """Raises ConfigError unless value reads 'N steps' or 'N epochs' (checked before any compute)."""
  _parse_duration(value, field)


def to_steps(value, field: str, steps_per_epoch: int) -> int:
  """Resolves a duration such as '500 steps' or '10 epochs' to optimizer steps.

  Durations stay in the unit they were written in until the job knows its
  dataset size and global batch: '10 epochs' is 10 * steps_per_epoch steps
  (rounded to the nearest step) whatever --config.batch_size says.

  Raises:
    ConfigError: not of the form 'N steps' / 'N epochs' (N > 0; steps whole),
      or a duration that rounds to 0 steps.
  """
  number, unit = _parse_duration(value, field)
  steps = int(number) if unit == "steps" else int(round(number * steps_per_epoch))
  if steps <= 0:
    raise ConfigError(field, value, f"a duration of at least one step; at {steps_per_epoch} "
                      "steps per epoch it rounds to 0 steps")
  return steps


def simclr_view(strength: float, blur_prob: float) -> dict:
  """SimCLR's on-device view settings (Appendix A): jitter strength s, grayscale 0.2."""
  return dict(brightness=0.8 * strength, contrast=0.8 * strength, saturation=0.8 * strength,
              hue=0.2 * strength, color_jitter_prob=0.8, grayscale_prob=0.2,
              blur_prob=blur_prob)


def data_fields(config):
  """Sets the fields every job reads its data with (CIFAR-10 from TFDS by default)."""
  config.seed = 0
  config.data_source = "tfds"
  config.dataset = "cifar10"
  config.data_dir = config_dict.placeholder(str)  # None: TFDS_DATA_DIR or ~/tensorflow_datasets.
  config.train_split = "train"
  config.cache = True  # Keep decoded images in host memory (small datasets only).
  config.shuffle_buffer = 50_000
  config.data_threads = 2
  return config


def pretrained_encoder_fields(config):
  """Sets the fields that say which encoder a downstream job starts from (downstream.py)."""
  config.pretrain_workdir = config_dict.placeholder(str)  # The pretraining job's --workdir.
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
  config.image_size = 32
  config.crop_area_min = 0.08
  config.eval_crop_fraction = 1.0
  config.duration = "100 epochs"
  config.log_every = "100 steps"
  config.checkpoint_every = "1000 steps"
  config.keep_checkpoints = 3
  # Each evaluator also runs at the last step; the kNN monitor at step 0 too.
  config.evaluators = dict(
      knn=dict(kind="knn", every="10 epochs", split="test", bank_split="train", k=200,
               temperature=0.1, batch_size=1000),
      online_probe=dict(kind="classifier", every="10 epochs", split="test", batch_size=1000))
  config.online_probe = dict(learning_rate=1e-3)
  return config


def moco_v1_view() -> dict:
  """MoCo v1's views (He et al. 2019, Sec. 4.1): jitter 0.4 on all four, always; grayscale 0.2."""
  return dict(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.4, color_jitter_prob=1.0,
              grayscale_prob=0.2)


def moco_v2_view(blur_prob: float) -> dict:
  """MoCo v2's views (Chen et al. 2020b): jitter (0.4, 0.4, 0.4, 0.1) p 0.8, grayscale 0.2, blur."""
  return dict(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1, color_jitter_prob=0.8,
              grayscale_prob=0.2, blur_prob=blur_prob)


def byol_views() -> dict:
  """BYOL's asymmetric views (Grill et al. 2020, Table 6): view 1 always blurred, never
  solarized; view 2 blurred with p 0.1 and solarized with p 0.2."""
  jitter = dict(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1, color_jitter_prob=0.8,
                grayscale_prob=0.2)
  return dict(view1=dict(jitter, blur_prob=1.0, solarize_prob=0.0),
              view2=dict(jitter, blur_prob=0.1, solarize_prob=0.2))


def runlocal(config):
  """Shrinks a CIFAR-10 config to 8-12 minutes on a 2-core CPU, same code path.

  Narrow ResNet-18 (width 0.25: 16 to 128 channels) with the ImageNet stem,
  whose stride 4 makes the step ~8x cheaper on 32x32 images than the CIFAR
  stem (the difference between ~3 and ~8 epochs in the time); batch 256,
  1500 steps (~7.7 epochs), evaluators every 500 steps.
  """
  config.batch_size = 256
  config.duration = "1500 steps"
  config.model.width = 0.25
  config.model.stem = "imagenet"
  config.optimizer.warmup_epochs = 1
  config.log_every = "20 steps"
  config.checkpoint_every = "200 steps"
  for evaluator in config.evaluators.values():
    evaluator.every = "500 steps"
  return config


def optimizer(name: str, base_lr: float, weight_decay: float, **overrides) -> dict:
  """An optimizer config: warm-up then cosine by default, linear lr scaling.

  schedule 'step' multiplies the lr by decay_factor at each of decay_epochs.
  """
  config = dict(name=name, base_lr=base_lr, lr_scaling="linear", weight_decay=weight_decay,
                momentum=0.9, trust_coefficient=0.001, warmup_epochs=10, schedule="cosine",
                decay_epochs=(), decay_factor=0.1)
  config.update(overrides)
  return config


def imagenet(config, *, batch_size: int, num_epochs: int):
  """Sets ImageNet (TFDS imagenet2012, 224 px) data fields and a ResNet-50 in bfloat16.

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
  config.model = dict(name="resnet50", width=1.0, stem="imagenet", dtype="bfloat16")
  config.checkpoint_every = "2000 steps"
  for evaluator in config.evaluators.values():
    evaluator.split = "validation"
    evaluator.batch_size = 1024
  config.evaluators.knn.bank_split = "train[:10%]"
  return config


def images(config, *, batch_size: int, num_epochs: int):
  """Sets an image folder prepared by prepare_images as the data: 224 px, ResNet-18.

  Name the folder's dataset with --config.dataset=NAME --config.data_dir=DIR
  (the default 'clothing' is the README's example); --config.image_size from
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
  config.model = dict(name="resnet18", width=1.0, stem="imagenet", dtype="float32")
  config.evaluators.knn.k = 20
  return config


def runlocal_images(config, *, steps: int):
  """Shrinks an image-folder config for a 2-core CPU, same code path.

  64 px crops, ResNet-18 at width 0.25 (16 to 128 channels), batch 128,
  decoded images cached in memory, `steps` steps, evaluators every
  steps / 4. Sized for about 10 minutes; on the shared 2-core VM of the
  README (load average 6 to 13) 400 steps on clothing took 18 to 20 minutes.
  """
  config.image_size = 64
  config.batch_size = 128
  config.duration = f"{steps} steps"
  config.model.width = 0.25
  config.cache = True
  config.optimizer.warmup_epochs = 1
  config.log_every = "10 steps"
  config.checkpoint_every = f"{steps // 4} steps"
  for evaluator in config.evaluators.values():
    evaluator.every = f"{steps // 4} steps"
    evaluator.batch_size = 256
  return config
