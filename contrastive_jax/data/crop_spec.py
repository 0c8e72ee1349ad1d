"""What a job's training crop is (config.crop): the references' samplers and resizes, their
constants, CropSpec and its check.

TensorFlow-free, so that both crop paths share it: the host's tf ops (crops.py)
and the device's jax.random twin (device_data.py), the latter on images without
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
