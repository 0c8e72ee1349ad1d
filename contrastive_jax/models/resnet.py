"""ResNet-10/18/34/50 encoders (He et al. 2016) in Flax Linen.

The output h (after global average pooling) is the representation used
downstream. Parameters are float32; `dtype` sets the compute dtype of
convolutions (bfloat16 on accelerators); h is returned in float32.
Convolutions are initialised He-normal fan-out (torchvision: MoCo) or with
variance scaling 1 fan-in truncated normal (TF's variance_scaling_initializer:
SimCLR; Haiku's default: BYOL); the last BN scale of each residual block is
zero (SimCLR, BYOL's code) or one (torchvision: MoCo).

Padding follows the reference whose weights a config means to match
(PADDINGS); the references differ only where a convolution or the max-pool is
strided, as 'SAME' pads an even input after it only.

The family API of the model registry (models/__init__.py): SPECS, check_config,
build_encoder and encoder_width.
"""

import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.models import common
from contrastive_jax.models import conv as conv_lib

# name -> (block type, blocks per stage); He et al. 2016, Table 1, and ResNet-10, one basic
# block per stage (as in Chen et al. 2019, "A Closer Look at Few-shot Classification"): the
# smallest, for trial runs on a CPU and the tests' tiny configs (a train step of BYOL's
# compiles in about two thirds of ResNet-18's time).
SPECS = {
  "resnet10": ("basic", (1, 1, 1, 1)),
  "resnet18": ("basic", (2, 2, 2, 2)),
  "resnet34": ("basic", (3, 4, 6, 3)),
  "resnet50": ("bottleneck", (3, 4, 6, 3)),
}
STEMS = ("cifar", "imagenet")
CONV_INITS = {
  "he_normal": nn.initializers.variance_scaling(2.0, "fan_out", "normal"),
  "variance_scaling": nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"),
}
# Where strided layers pad (a stride-1 k x k convolution pads (k-1)/2 on each side in all):
#   'torchvision': every convolution and the stem's 3x3 max-pool pad (k-1)//2 on each side
#       (torchvision resnet.py: conv padding k//2, MaxPool2d(3, 2, padding=1) with -inf).
#   'tensorflow': strided convolutions pad (k-1)//2 before and the rest after, then VALID;
#       the max-pool is 'SAME' (SimCLR's TF ResNet, resnet.py: conv2d_fixed_padding /
#       Conv2dFixedPadding, max pooling padding 'SAME').
#   'same': 'SAME' everywhere, the 7x7 stem included (Haiku's Conv2D and max_pool: BYOL's
#       networks.py).
#   'legacy': the 7x7 stem pads (3, 3), everything else is 'SAME'; the rule of a saved config
#       without model.padding (config_files.upgrade_config), so that its checkpoint restores
#       to the network it trained.
PADDINGS = ("torchvision", "tensorflow", "same", "legacy")


def conv_padding(kernel: int, strides: int, padding: str, stem: bool = False):
  """The flax padding of a k x k convolution with `strides` under PADDINGS rule `padding`."""
  symmetric = [((kernel - 1) // 2, kernel - 1 - (kernel - 1) // 2)] * 2
  if strides > 1 and (padding in ("torchvision", "tensorflow") or (stem and padding == "legacy")):
    return symmetric
  return "SAME"


def max_pool_padding(padding: str):
  """The flax padding of the stem's 3x3 stride-2 max-pool under PADDINGS rule `padding`
  (explicit pads are -inf: they never win the max)."""
  return [(1, 1), (1, 1)] if padding == "torchvision" else "SAME"


def _residual_out(x, y, strides: int, conv, norm, project: bool):
  """relu(y + x), x projected by a strided 1x1 conv + BN where the shapes differ or
  project says so.

  Called from a block's compact __call__, so the projection's layers belong to
  that block.
  """
  if project or x.shape != y.shape:
    x = norm()(conv(y.shape[-1], 1, strides)(x))
  return nn.relu(y + x)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with a residual connection (ResNet-10/18/34).

  conv(features, kernel, strides=1) builds a convolution padded as the ResNet's
  padding rule says; last_norm builds the block's last BN (zero-initialised
  scale or not); project: a projection shortcut even where the shapes agree.
  """

  features: int
  strides: int
  conv: Callable
  norm: Callable
  last_norm: Callable
  project: bool = False

  @nn.compact
  def __call__(self, x):
    y = self.conv(self.features, 3, self.strides)(x)
    y = nn.relu(self.norm()(y))
    y = self.conv(self.features, 3)(y)
    y = self.last_norm()(y)
    return _residual_out(x, y, self.strides, self.conv, self.norm, self.project)


class BottleneckBlock(nn.Module):
  """1x1 -> 3x3 -> 1x1 convolutions with 4x expansion (ResNet-50)."""

  features: int
  strides: int
  conv: Callable
  norm: Callable
  last_norm: Callable
  project: bool = False

  @nn.compact
  def __call__(self, x):
    y = nn.relu(self.norm()(self.conv(self.features, 1)(x)))
    y = self.conv(self.features, 3, self.strides)(y)
    y = nn.relu(self.norm()(y))
    y = self.conv(self.features * 4, 1)(y)
    y = self.last_norm()(y)
    return _residual_out(x, y, self.strides, self.conv, self.norm, self.project)


class ResNet(nn.Module):
  """ResNet encoder (He et al. 2016) with a width multiplier.

  Attributes:
    depth_spec: (block type, blocks per stage), a value of SPECS.
    width: channel multiplier; stage widths are round(64 * 2**i * width).
    stem: 'cifar' (3x3 stride-1 conv, no max-pool; SimCLR Appendix B.9) or
      'imagenet' (7x7 stride-2 conv and 3x3 stride-2 max-pool).
    dtype: compute dtype.
    bn_axis_name: mesh axis over which BatchNorm statistics are averaged
      (global BN); None for per-device statistics.
    zero_init_residual: the last BN scale of each block starts at 0, so that
      each block starts as the identity (Goyal et al. 2017; SimCLR's and
      BYOL's code), or at 1 (torchvision's default: MoCo).
    conv_init: a key of CONV_INITS.
    padding: a PADDINGS rule.
    stage_projection: the first block of every stage has a projection shortcut
      (SimCLR's TF ResNet: BlockGroup's use_projection=True; Haiku's ResNet,
      which BYOL's networks.py builds with use_projection True for all four
      groups), the first stage's too, where its input and output have the same
      shape; otherwise only blocks that change the shape have one (torchvision).
      Only ResNet-10/18/34 differ: a bottleneck stage's first block always changes
      the width.
    input_mean, input_std: per-channel (R, G, B) statistics subtracted from
      and divided into the [0, 1] input (MoCo and BYOL standardise with the
      ImageNet statistics; (0, 0, 0) and (1, 1, 1) leave it as SimCLR does).
  """

  depth_spec: tuple
  width: float = 1.0
  stem: str = "imagenet"
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None
  zero_init_residual: bool = True
  conv_init: str = "he_normal"
  padding: str = "torchvision"
  stage_projection: bool = False
  input_mean: Sequence[float] = (0.0, 0.0, 0.0)
  input_std: Sequence[float] = (1.0, 1.0, 1.0)

  @nn.compact
  def __call__(self, x, train: bool):
    """Maps images [N, H, W, 3] (float, values in [0, 1]) to h [N, C] float32."""
    block_type, stage_sizes = self.depth_spec
    block_cls = BasicBlock if block_type == "basic" else BottleneckBlock

    def conv(features, kernel, strides=1, stem=False, **kwargs):
      return nn.Conv(
        features,
        (kernel, kernel),
        (strides, strides),
        padding=conv_padding(kernel, strides, self.padding, stem),
        use_bias=False,
        dtype=self.dtype,
        kernel_init=CONV_INITS[self.conv_init],
        conv_general_dilated=conv_lib.conv_general_dilated,
        **kwargs,
      )

    norm = functools.partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=0.9,
      epsilon=1e-5,
      dtype=self.dtype,
      axis_name=self.bn_axis_name if train else None,
    )
    last_norm = functools.partial(
      norm, scale_init=nn.initializers.zeros if self.zero_init_residual else nn.initializers.ones
    )
    base = max(1, round(64 * self.width))
    x = (x - jnp.asarray(self.input_mean, jnp.float32)) / jnp.asarray(self.input_std, jnp.float32)
    x = x.astype(self.dtype)
    if self.stem == "cifar":
      x = conv(base, 3, name="stem_conv")(x)
      x = nn.relu(norm(name="stem_bn")(x))
    else:
      x = conv(base, 7, 2, stem=True, name="stem_conv")(x)
      x = nn.relu(norm(name="stem_bn")(x))
      x = conv_lib.max_pool(x, (3, 3), (2, 2), max_pool_padding(self.padding))
    for i, num_blocks in enumerate(stage_sizes):
      for j in range(num_blocks):
        strides = 2 if i > 0 and j == 0 else 1
        x = block_cls(
          base * 2**i, strides, conv, norm, last_norm, project=self.stage_projection and j == 0
        )(x)
    return jnp.mean(x, axis=(1, 2)).astype(jnp.float32)


def check_config(model_config, image_size: int = None):
  """Raises ConfigError naming the first field of a ResNet config (name in SPECS) that
  cannot be built; any image_size works (global average pooling)."""
  del image_size
  if model_config.stem not in STEMS:
    raise ConfigError("model.stem", model_config.stem, f"one of {list(STEMS)}")
  if not model_config.width > 0:
    raise ConfigError("model.width", model_config.width, "a number > 0")
  if model_config.conv_init not in CONV_INITS:
    raise ConfigError("model.conv_init", model_config.conv_init, f"one of {sorted(CONV_INITS)}")
  if model_config.padding not in PADDINGS:
    raise ConfigError("model.padding", model_config.padding, f"one of {list(PADDINGS)}")
  if not isinstance(model_config.stage_projection, bool):
    raise ConfigError("model.stage_projection", model_config.stage_projection, "True or False")
  common.check_input_statistics(model_config)


def build_encoder(model_config, bn_axis_name=None) -> ResNet:
  """The ResNet of a checked config: fields name (SPECS), width, stem, dtype,
  zero_init_residual, conv_init, padding, stage_projection, input_mean, input_std;
  BN statistics averaged over the mesh axis bn_axis_name (None: per device)."""
  input_mean, input_std = common.input_statistics(model_config)
  return ResNet(
    SPECS[model_config.name],
    width=model_config.width,
    stem=model_config.stem,
    dtype=common.DTYPES[model_config.dtype],
    bn_axis_name=bn_axis_name,
    zero_init_residual=model_config.zero_init_residual,
    conv_init=model_config.conv_init,
    padding=model_config.padding,
    stage_projection=model_config.stage_projection,
    input_mean=input_mean,
    input_std=input_std,
  )


def encoder_width(model_config) -> int:
  """Dimension of h: 512 x width for ResNet-10/18/34, 2048 x width for ResNet-50 (the last
  stage's channels, round(64 x width) x 8, x 4 for a bottleneck)."""
  block_type, _ = SPECS[model_config.name]
  base = max(1, round(64 * model_config.width))
  return base * 8 * (4 if block_type == "bottleneck" else 1)
