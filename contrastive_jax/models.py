"""Encoders (ResNet; ViT in vit.py) and MLP heads (projection head, predictor) in Flax Linen.

The encoder output h (after global average pooling) is the representation used
downstream (linear probe, kNN monitor); the projection head maps it to z, which
feeds the contrastive loss (SimCLR, Chen et al. 2020, Sec. 2.1).

Parameters are always float32; `dtype` sets the compute dtype of convolutions and
dense layers (bfloat16 on accelerators). BatchNorm statistics are reduced in
float32 by Flax. Outputs h and z are returned in float32 so that similarity
logits and losses are computed in float32.

Initialisations follow the references (model and head configs choose them):
convolutions He-normal fan-out (torchvision: MoCo) or variance scaling 1 fan-in
truncated normal (TF's variance_scaling_initializer: SimCLR; Haiku's default:
BYOL); dense layers Flax's/Haiku's default (BYOL), normal(0, 0.01) (SimCLR's
linear_layer) or PyTorch's nn.Linear default (MoCo); the last BN scale of each
residual block zero (SimCLR, BYOL's code) or one (torchvision: MoCo).
"""
import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from contrastive_jax import vit
from contrastive_jax.errors import ConfigError

# name -> (block type, blocks per stage); He et al. 2016, Table 1.
RESNET_SPECS = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
}
# name -> (width D, depth, heads). Tiny is DeiT-Ti (Touvron et al. 2021, Table 1); Small
# and Base are MoCo v3's (vits.py): its ViT-S has 12 heads where DeiT-S has 6 (the
# parameters are the same, the attention finer).
VIT_SPECS = {
    "vit_tiny": (192, 12, 3),
    "vit_small": (384, 12, 12),
    "vit_base": (768, 12, 12),
}
STEMS = ("cifar", "imagenet")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
CONV_INITS = {
    "he_normal": nn.initializers.variance_scaling(2.0, "fan_out", "normal"),
    "variance_scaling": nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"),
}
DENSE_INITS = ("lecun_normal", "normal_0.01", "torch")


def _residual_out(x, y, strides: int, conv, norm):
  """relu(y + x), x projected by a strided 1x1 conv + BN where the shapes differ.

  Called from a block's compact __call__, so the projection's layers belong to
  that block.
  """
  if x.shape != y.shape:
    x = norm()(conv(y.shape[-1], (1, 1), (strides, strides))(x))
  return nn.relu(y + x)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with a residual connection (ResNet-18/34).

  last_norm builds the block's last BN (zero-initialised scale or not).
  """
  features: int
  strides: int
  conv: Callable
  norm: Callable
  last_norm: Callable

  @nn.compact
  def __call__(self, x):
    y = self.conv(self.features, (3, 3), (self.strides, self.strides))(x)
    y = nn.relu(self.norm()(y))
    y = self.conv(self.features, (3, 3))(y)
    y = self.last_norm()(y)
    return _residual_out(x, y, self.strides, self.conv, self.norm)


class BottleneckBlock(nn.Module):
  """1x1 -> 3x3 -> 1x1 convolutions with 4x expansion (ResNet-50)."""
  features: int
  strides: int
  conv: Callable
  norm: Callable
  last_norm: Callable

  @nn.compact
  def __call__(self, x):
    y = nn.relu(self.norm()(self.conv(self.features, (1, 1))(x)))
    y = self.conv(self.features, (3, 3), (self.strides, self.strides))(y)
    y = nn.relu(self.norm()(y))
    y = self.conv(self.features * 4, (1, 1))(y)
    y = self.last_norm()(y)
    return _residual_out(x, y, self.strides, self.conv, self.norm)


class ResNet(nn.Module):
  """ResNet encoder (He et al. 2016) with a width multiplier.

  Attributes:
    depth_spec: (block type, blocks per stage), a value of RESNET_SPECS.
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
  input_mean: Sequence[float] = (0.0, 0.0, 0.0)
  input_std: Sequence[float] = (1.0, 1.0, 1.0)

  @nn.compact
  def __call__(self, x, train: bool):
    """Maps images [N, H, W, 3] (float, values in [0, 1]) to h [N, C] float32."""
    block_type, stage_sizes = self.depth_spec
    block_cls = BasicBlock if block_type == "basic" else BottleneckBlock
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype,
                             kernel_init=CONV_INITS[self.conv_init])
    norm = functools.partial(nn.BatchNorm, use_running_average=not train,
                             momentum=0.9, epsilon=1e-5, dtype=self.dtype,
                             axis_name=self.bn_axis_name if train else None)
    last_norm = functools.partial(norm, scale_init=nn.initializers.zeros
                                  if self.zero_init_residual else nn.initializers.ones)
    base = max(1, round(64 * self.width))
    x = (x - jnp.asarray(self.input_mean, jnp.float32)) / jnp.asarray(self.input_std, jnp.float32)
    x = x.astype(self.dtype)
    if self.stem == "cifar":
      x = conv(base, (3, 3), name="stem_conv")(x)
      x = nn.relu(norm(name="stem_bn")(x))
    else:
      x = conv(base, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="stem_conv")(x)
      x = nn.relu(norm(name="stem_bn")(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, num_blocks in enumerate(stage_sizes):
      for j in range(num_blocks):
        strides = 2 if i > 0 and j == 0 else 1
        x = block_cls(base * 2**i, strides, conv, norm, last_norm)(x)
    return jnp.mean(x, axis=(1, 2)).astype(jnp.float32)


def _dense_inits(name: str, fan_in: int):
  """(kernel_init, bias_init) of a dense layer with fan_in inputs, by DENSE_INITS name.

  'lecun_normal': truncated normal of variance 1/fan_in and zero bias (Flax's
  default, Haiku's hk.Linear: BYOL); 'normal_0.01': normal(0, 0.01) and zero
  bias (SimCLR's linear_layer); 'torch': U(+-1/sqrt(fan_in)) for both (PyTorch's
  nn.Linear: MoCo).
  """
  if name == "lecun_normal":
    return nn.initializers.lecun_normal(), nn.initializers.zeros
  if name == "normal_0.01":
    return nn.initializers.normal(0.01), nn.initializers.zeros
  bound = 1.0 / fan_in**0.5
  uniform = lambda key, shape, dtype=jnp.float32: jax.random.uniform(
      key, shape, dtype, -bound, bound)
  return uniform, uniform


class MLP(nn.Module):
  """Projection head or predictor: [Dense -> BN -> ReLU] * len(hidden) -> Dense [-> BN].

  SimCLR's projection head (Chen et al. 2020, Eq. 2 and Appendix B.1;
  model_util.projection_head: the last Dense has no bias and is followed by a
  BN with a scale but no offset, final_bn=True), MoCo v2's MLP head (no BN),
  BYOL's projector/predictor (Grill et al. 2020, Sec. 3.3) and MoCo v3's
  (moco-v3 builder.py _build_mlp: the projector's last BN without affine
  parameters, final_bn_scale=False; the predictor's last Dense without bias,
  final_bias=False) all have this shape. Dense layers followed by a BN have
  no bias (the BN's mean subtraction cancels it). dense_init: a DENSE_INITS
  name. Maps [N, D_in] to [N, out_dim] float32.
  """
  hidden_dims: Sequence[int]
  out_dim: int
  use_bn: bool = True
  final_bn: bool = False
  final_bn_scale: bool = True
  final_bias: bool = True
  dense_init: str = "lecun_normal"
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None

  @nn.compact
  def __call__(self, x, train: bool):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype,
                             axis_name=self.bn_axis_name if train else None)
    for width in self.hidden_dims:
      kernel_init, bias_init = _dense_inits(self.dense_init, x.shape[-1])
      x = nn.Dense(width, use_bias=not self.use_bn, dtype=self.dtype, kernel_init=kernel_init,
                   bias_init=bias_init)(x)
      if self.use_bn:
        x = norm()(x)
      x = nn.relu(x)
    kernel_init, bias_init = _dense_inits(self.dense_init, x.shape[-1])
    x = nn.Dense(self.out_dim, use_bias=self.final_bias and not self.final_bn,
                 dtype=self.dtype, kernel_init=kernel_init, bias_init=bias_init)(x)
    if self.final_bn:
      x = norm(use_bias=False, use_scale=self.final_bn_scale)(x)
    return x.astype(jnp.float32)


class ContrastiveModel(nn.Module):
  """Encoder + projection head (+ optional predictor).

  Returns (h, z) or, with a predictor, (h, z, p): h [N, C] the representation,
  z [N, head.out_dim] the projection, p [N, predictor.out_dim] the prediction;
  all float32. Submodules are named 'encoder', 'projector', 'predictor' so that
  downstream jobs can pick out `params['encoder']`.
  """
  encoder: nn.Module
  projector: nn.Module
  predictor: Optional[nn.Module] = None

  def __call__(self, x, train: bool):
    h = self.encoder(x, train=train)
    z = self.projector(h, train=train)
    if self.predictor is None:
      return h, z
    return h, z, self.predictor(z, train=train)


def encode(encoder, variables, images):
  """Eval-mode representation h, float32 [B, D], of uint8 images [B, S, S, 3].

  Pixels are scaled to [0, 1] as in training; BN uses its running statistics.
  variables: {'params', 'batch_stats'} ('batch_stats' empty for a ViT).
  """
  return encoder.apply(variables, images.astype(jnp.float32) / 255.0, train=False)


# Fields added to model and head configs after checkpoints were first written:
# a saved config without them gets the values the code had then.
_MODEL_DEFAULTS = dict(zero_init_residual=True, conv_init="he_normal",
                       input_mean=(0.0, 0.0, 0.0), input_std=(1.0, 1.0, 1.0))
_MLP_DEFAULTS = dict(final_bn=False, init="lecun_normal", final_bn_scale=True, final_bias=True)


def build_encoder(model_config, bn_axis_name=None) -> nn.Module:
  """Builds the encoder named by `model_config`: a ResNet of RESNET_SPECS (fields
  name, width, stem, dtype, zero_init_residual, conv_init, input_mean, input_std)
  or a ViT of VIT_SPECS (name, width, depth, patch_size, dtype,
  random_patch_projection, input_mean, input_std; no BN, so bn_axis_name is
  unused): D = vit_width(model_config), depth blocks, the spec's heads.

  Raises:
    ConfigError: see check_model_config.
  """
  check_model_config(model_config)
  get = lambda field: model_config.get(field, _MODEL_DEFAULTS[field])
  if model_config.name in VIT_SPECS:
    return vit.ViT(vit_width(model_config), model_config.depth, VIT_SPECS[model_config.name][2],
                   model_config.patch_size, dtype=DTYPES[model_config.dtype],
                   random_patch_projection=model_config.random_patch_projection,
                   input_mean=tuple(get("input_mean")), input_std=tuple(get("input_std")))
  return ResNet(RESNET_SPECS[model_config.name], width=model_config.width,
                stem=model_config.stem, dtype=DTYPES[model_config.dtype],
                bn_axis_name=bn_axis_name, zero_init_residual=get("zero_init_residual"),
                conv_init=get("conv_init"), input_mean=tuple(get("input_mean")),
                input_std=tuple(get("input_std")))


def build_mlp(mlp_config, dtype_name, bn_axis_name=None) -> MLP:
  """Builds an MLP head from a config with hidden_dims, out_dim, use_bn, final_bn, init
  and optionally final_bn_scale, final_bias (MLP's attributes)."""
  get = lambda field: mlp_config.get(field, _MLP_DEFAULTS[field])
  return MLP(tuple(mlp_config.hidden_dims), mlp_config.out_dim,
             use_bn=mlp_config.use_bn, final_bn=get("final_bn"),
             final_bn_scale=get("final_bn_scale"), final_bias=get("final_bias"),
             dense_init=get("init"),
             dtype=DTYPES[dtype_name], bn_axis_name=bn_axis_name)


def encoder_width(model_config) -> int:
  """Dimension of h for a model config (512 * width, or 2048 * width for R50; D for a ViT)."""
  if model_config.name in VIT_SPECS:
    return vit_width(model_config)
  block_type, _ = RESNET_SPECS[model_config.name]
  base = max(1, round(64 * model_config.width))
  return base * 8 * (4 if block_type == "bottleneck" else 1)


def vit_width(model_config) -> int:
  """D of a ViT config: the spec's D times model.width, rounded (a runlocal shrinks it)."""
  return round(VIT_SPECS[model_config.name][0] * model_config.width)


def check_model_config(model_config, image_size: int = None):
  """Raises ConfigError naming the field if the model config cannot be built (on images
  of image_size pixels, when given: a ViT's patch size must divide it)."""
  if model_config.name not in RESNET_SPECS and model_config.name not in VIT_SPECS:
    raise ConfigError("model.name", model_config.name,
                      f"one of {sorted(RESNET_SPECS) + sorted(VIT_SPECS)}")
  if model_config.dtype not in DTYPES:
    raise ConfigError("model.dtype", model_config.dtype, f"one of {sorted(DTYPES)}")
  if model_config.name in VIT_SPECS:
    _check_vit_config(model_config, image_size)
    return
  if model_config.stem not in STEMS:
    raise ConfigError("model.stem", model_config.stem, f"one of {list(STEMS)}")
  if not model_config.width > 0:
    raise ConfigError("model.width", model_config.width, "a number > 0")
  conv_init = model_config.get("conv_init", _MODEL_DEFAULTS["conv_init"])
  if conv_init not in CONV_INITS:
    raise ConfigError("model.conv_init", conv_init, f"one of {sorted(CONV_INITS)}")
  _check_input_statistics(model_config)


def _check_input_statistics(model_config):
  for field in ("input_mean", "input_std"):
    value = model_config.get(field, _MODEL_DEFAULTS[field])
    if len(value) != 3 or (field == "input_std" and min(value) <= 0):
      raise ConfigError(f"model.{field}", tuple(value),
                        "3 numbers (R, G, B)" + (", each > 0" if field == "input_std" else ""))


def _check_vit_config(model_config, image_size):
  heads = VIT_SPECS[model_config.name][2]
  if not model_config.width > 0 or vit_width(model_config) % (4 * heads):
    raise ConfigError("model.width", model_config.width,
                      f"> 0, making D = {VIT_SPECS[model_config.name][0]} x width a multiple "
                      f"of 4 x {heads} heads (the 2-D sin-cos embedding splits D in 4)")
  if not isinstance(model_config.get("depth"), int) or model_config.depth <= 0:
    raise ConfigError("model.depth", model_config.get("depth"), "an integer > 0 (blocks)")
  patch = model_config.get("patch_size")
  if not isinstance(patch, int) or patch <= 0 or (image_size and image_size % patch):
    raise ConfigError("model.patch_size", patch,
                      "an integer > 0" + (f" that divides image_size ({image_size})"
                                          if image_size else ""))
  if not isinstance(model_config.get("random_patch_projection"), bool):
    raise ConfigError("model.random_patch_projection",
                      model_config.get("random_patch_projection"), "True or False")
  _check_input_statistics(model_config)


def check_mlp_config(mlp_config, field):
  """Raises ConfigError if an MLP head config has a width <= 0 or an unknown init."""
  for i, width in enumerate(mlp_config.hidden_dims):
    if width <= 0:
      raise ConfigError(f"{field}.hidden_dims[{i}]", width, "an integer > 0")
  if mlp_config.out_dim <= 0:
    raise ConfigError(f"{field}.out_dim", mlp_config.out_dim, "an integer > 0")
  init = mlp_config.get("init", _MLP_DEFAULTS["init"])
  if init not in DENSE_INITS:
    raise ConfigError(f"{field}.init", init, f"one of {list(DENSE_INITS)}")
