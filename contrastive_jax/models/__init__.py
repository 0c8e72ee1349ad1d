"""The model registry: encoders by model family, projection heads (heads.py), by config.

A model family is a module that owns its spec table and builds the encoders
of its names: resnet.py (ResNet-10/18/34/50) and vit.py (ViT-Tiny/Small/Base/Large/Giant),
each one entry of FAMILIES. A family module provides

  SPECS: {model name: spec}
      The names config.model.name may take in the family.
  check_config(model_config, image_size=None) -> None
      Raises ConfigError naming the first of the family's fields that cannot
      be built (on images of image_size pixels, when given).
  build_encoder(model_config, bn_axis_name=None) -> flax.linen.Module
      The encoder of a checked config; module.apply(variables, images, train)
      maps float [N, S, S, 3] images in [0, 1] to h float32 [N, D]; its BN
      statistics, if any, averaged over the mesh axis bn_axis_name.
  encoder_width(model_config) -> int
      D, the dimension of h.

The encoder output h is the representation used downstream (linear probe,
kNN monitor); the projection head maps it to z for the loss. Parameters are
always float32; a model config's `dtype` sets the compute dtype (bfloat16 on
accelerators); h and z are float32.
"""

from flax import linen as nn
import jax.numpy as jnp

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.models import common
from contrastive_jax.models import resnet
from contrastive_jax.models import vit
from contrastive_jax.models.heads import DENSE_INITS
from contrastive_jax.models.heads import MLP

FAMILIES = {"resnet": resnet, "vit": vit}


def encode(encoder, variables, images):
  """Eval-mode representation h, float32 [B, D], of uint8 images [B, S, S, 3].

  Pixels are scaled to [0, 1] as in training; BN uses its running statistics.
  variables: {'params', 'batch_stats'} ('batch_stats' empty for a ViT).
  """
  return encoder.apply(variables, images.astype(jnp.float32) / 255.0, train=False)


# The value of each head field a config may leave out (most do): no BN after the last
# layer (a scale in it, were there one), a bias in the last layer.
_MLP_DEFAULTS = dict(final_bn=False, final_bn_scale=True, final_bias=True)


def family(model_config) -> str:
  """The FAMILIES key of the family whose SPECS hold model_config.name.

  Raises:
    ConfigError: a name in no family's SPECS (listing every family's names).
  """
  found = [key for key, module in FAMILIES.items() if model_config.name in module.SPECS]
  if not found:
    names = sorted(name for module in FAMILIES.values() for name in module.SPECS)
    raise ConfigError("model.name", model_config.name, f"one of {names}")
  return found[0]


def build_encoder(model_config, bn_axis_name=None) -> nn.Module:
  """Builds the encoder named by `model_config` with its family's build_encoder (the
  fields each family reads: resnet.build_encoder, vit.build_encoder); BN statistics
  averaged over the mesh axis bn_axis_name (None: per device; a ViT has no BN).

  Raises:
    ConfigError: see check_model_config.
  """
  check_model_config(model_config)
  return FAMILIES[family(model_config)].build_encoder(model_config, bn_axis_name)


def build_mlp(mlp_config, dtype_name, bn_axis_name=None) -> MLP:
  """Builds an MLP head from a config with hidden_dims, out_dim, use_bn, init and
  optionally final_bn, final_bn_scale, final_bias (MLP's attributes; _MLP_DEFAULTS)."""
  get = lambda field: mlp_config.get(field, _MLP_DEFAULTS[field])
  return MLP(
    tuple(mlp_config.hidden_dims),
    mlp_config.out_dim,
    use_bn=mlp_config.use_bn,
    final_bn=get("final_bn"),
    final_bn_scale=get("final_bn_scale"),
    final_bias=get("final_bias"),
    dense_init=mlp_config.init,
    dtype=common.DTYPES[dtype_name],
    bn_axis_name=bn_axis_name,
  )


def encoder_width(model_config) -> int:
  """D, the dimension of h, of a model config (512 x width for ResNet-10/18/34, 2048 x width
  for ResNet-50, the spec's D x width for a ViT: each family's encoder_width).

  Raises:
    ConfigError: see family.
  """
  return FAMILIES[family(model_config)].encoder_width(model_config)


def check_model_config(model_config, image_size: int = None):
  """Raises ConfigError naming the field if the model config cannot be built (on images
  of image_size pixels, when given: a ViT's patch size must divide it): the name, the
  dtype, then the family's fields (its check_config)."""
  key = family(model_config)
  if model_config.dtype not in common.DTYPES:
    raise ConfigError("model.dtype", model_config.dtype, f"one of {sorted(common.DTYPES)}")
  FAMILIES[key].check_config(model_config, image_size)


def check_mlp_config(mlp_config, field):
  """Raises ConfigError if an MLP head config has a width <= 0 or an unknown init."""
  for i, width in enumerate(mlp_config.hidden_dims):
    if width <= 0:
      raise ConfigError(f"{field}.hidden_dims[{i}]", width, "an integer > 0")
  if mlp_config.out_dim <= 0:
    raise ConfigError(f"{field}.out_dim", mlp_config.out_dim, "an integer > 0")
  if mlp_config.init not in DENSE_INITS:
    raise ConfigError(f"{field}.init", mlp_config.init, f"one of {list(DENSE_INITS)}")
