"""What a job's training crop is (config.crop): the references' samplers and resizes, their
constants, CropSpec and its check.

TensorFlow-free, so that both crop paths share it: the host's tf ops (crops.py)
and the device's jax.random twin (device_samplers.py), the latter on images without
TensorFlow. crops.py's docstring describes each sampler and resize.
"""

from typing import NamedTuple

from contrastive_jax.core.errors import ConfigError

SAMPLERS = ("tensorflow", "torchvision", "byol")
# name -> (tf.image.resize method, antialias).
RESIZES = {
  "tf_bicubic": ("bicubic", False),
  "pil_bilinear": ("bilinear", True),
  "pil_bicubic": ("bicubic", True),
}
# SimCLR's constants for tf.image.sample_distorted_bounding_box.
SIMCLR_MIN_OBJECT_COVERED = 0.1
SIMCLR_MAX_ATTEMPTS = 100
TORCHVISION_ATTEMPTS = 10
ASPECT_RANGE = (3 / 4, 4 / 3)


class CropSpec(NamedTuple):
  """A job's config.crop: how its training views are cropped (random_resized_crop).

  sampler: one of SAMPLERS; area_min: the smallest crop, a fraction of the image's
  area in (0, 1]; resize: one of RESIZES (the evaluation's centre crop uses it too).
  Built with CropSpec(**config.crop) after check_config.
  """

  sampler: str
  area_min: float
  resize: str


def check_config(config):
  """Raises ConfigError for config.crop values (CropSpec's fields) that cannot run."""
  if config.crop.sampler not in SAMPLERS:
    raise ConfigError("crop.sampler", config.crop.sampler, f"one of {list(SAMPLERS)}")
  if config.crop.resize not in RESIZES:
    raise ConfigError("crop.resize", config.crop.resize, f"one of {sorted(RESIZES)}")
  if not 0 < config.crop.area_min <= 1:
    raise ConfigError("crop.area_min", config.crop.area_min, "in (0, 1]")


class LocalCrops(NamedTuple):
  """A job's config.local_crops: multi-crop's small views (Caron et al. 2020, SwAV Sec. 3.2;
  DINO main_dino.py DataAugmentationDINO's local_transfo).

  number: N local views per image (DINO's --local_crops_number); size: their side in
  pixels (96 in DINO at 224); area_min, area_max: the range of their area fraction
  (DINO's --local_crops_scale, 0.05 to 0.4). Each is drawn with config.crop's sampler
  and resize and flipped with p 1/2, as the global views. Built with
  LocalCrops(**config.local_crops) after check_local_crops.
  """

  number: int
  size: int
  area_min: float
  area_max: float


def check_local_crops(config):
  """Raises ConfigError for config.local_crops values (LocalCrops' fields) that cannot run;
  a config without local_crops passes."""
  local = config.get("local_crops")
  if local is None:
    return
  if not isinstance(local.number, int) or local.number <= 0:
    raise ConfigError("local_crops.number", local.number, "an integer > 0")
  if not isinstance(local.size, int) or local.size <= 0:
    raise ConfigError("local_crops.size", local.size, "an integer > 0 (pixels)")
  if not 0 < local.area_min < local.area_max <= 1:
    raise ConfigError(
      "local_crops.area_min", local.area_min, f"in (0, local_crops.area_max={local.area_max})"
    )
