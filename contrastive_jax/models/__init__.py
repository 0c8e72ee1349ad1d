"""The model registry: encoders (ResNet in resnet.py, ViT in vit.py) and heads (heads.py) by config.

The encoder output h is the representation used downstream (linear probe,
kNN monitor); the projection head maps it to z for the loss. Parameters are
always float32; a model config's `dtype` sets the compute dtype (bfloat16 on
accelerators); h and z are float32.
"""
from flax import linen as nn
import jax.numpy as jnp

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.models.heads import DENSE_INITS
from contrastive_jax.models.heads import MLP
from contrastive_jax.models.resnet import CONV_INITS
from contrastive_jax.models.resnet import DTYPES
from contrastive_jax.models.resnet import PADDINGS
from contrastive_jax.models.resnet import RESNET_SPECS
from contrastive_jax.models.resnet import ResNet
from contrastive_jax.models.resnet import STEMS
from contrastive_jax.models import vit

# name -> (width D, depth, heads). Tiny is DeiT-Ti (Touvron et al. 2021, Table 1); Small
# and Base are MoCo v3's (vits.py): its ViT-S has 12 heads where DeiT-S has 6 (the
# parameters are the same, the attention finer).
VIT_SPECS = {
    "vit_tiny": (192, 12, 3),
    "vit_small": (384, 12, 12),
    "vit_base": (768, 12, 12),
}

def encode(encoder, variables, images):
  """Eval-mode representation h, float32 [B, D], of uint8 images [B, S, S, 3].

  Pixels are scaled to [0, 1] as in training; BN uses its running statistics.
  variables: {'params', 'batch_stats'} ('batch_stats' empty for a ViT).
  """
  return encoder.apply(variables, images.astype(jnp.float32) / 255.0, train=False)


# Fields added to model and head configs after checkpoints were first written:
# a saved config without them gets the values the code had then.
_MODEL_DEFAULTS = dict(zero_init_residual=True, conv_init="he_normal",
                       input_mean=(0.0, 0.0, 0.0), input_std=(1.0, 1.0, 1.0), padding="legacy",
                       stage_projection=False, position_embedding="sincos", num_heads=None)
_MLP_DEFAULTS = dict(final_bn=False, init="lecun_normal", final_bn_scale=True, final_bias=True)


def build_encoder(model_config, bn_axis_name=None) -> nn.Module:
  """Builds the encoder named by `model_config`: a ResNet of RESNET_SPECS (fields
  name, width, stem, dtype, zero_init_residual, conv_init, padding,
  stage_projection, input_mean, input_std) or a ViT of VIT_SPECS (name, width, depth, patch_size, dtype,
  random_patch_projection, position_embedding, num_heads, input_mean,
  input_std; no BN, so bn_axis_name is unused): D = vit_width(model_config),
  depth blocks, num_heads heads (None: the spec's).

  Raises:
    ConfigError: see check_model_config.
  """
  check_model_config(model_config)
  get = lambda field: model_config.get(field, _MODEL_DEFAULTS[field])
  if model_config.name in VIT_SPECS:
    return vit.ViT(vit_width(model_config), model_config.depth, vit_heads(model_config),
                   model_config.patch_size, dtype=DTYPES[model_config.dtype],
                   random_patch_projection=model_config.random_patch_projection,
                   position_embedding=get("position_embedding"),
                   input_mean=tuple(get("input_mean")), input_std=tuple(get("input_std")))
  return ResNet(RESNET_SPECS[model_config.name], width=model_config.width,
                stem=model_config.stem, dtype=DTYPES[model_config.dtype],
                bn_axis_name=bn_axis_name, zero_init_residual=get("zero_init_residual"),
                conv_init=get("conv_init"), padding=get("padding"),
                stage_projection=get("stage_projection"),
                input_mean=tuple(get("input_mean")), input_std=tuple(get("input_std")))


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


def resnet_padding(model_config):
  """The PADDINGS rule of a ResNet config (a saved config without the field: 'legacy');
  None for a ViT."""
  if model_config.name in VIT_SPECS:
    return None
  return model_config.get("padding", _MODEL_DEFAULTS["padding"])


def vit_heads(model_config) -> int:
  """Attention heads of a ViT config: model.num_heads, or the spec's when unset (None).

  A checkpoint's shapes do not tell the heads (qkv is [D, 3D] whatever their
  number): timm's vit_small_patch16_224 has 6 where VIT_SPECS' vit_small has 12.
  """
  return model_config.get("num_heads") or VIT_SPECS[model_config.name][2]


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
  padding = resnet_padding(model_config)
  if padding not in PADDINGS:
    raise ConfigError("model.padding", padding, f"one of {list(PADDINGS)}")
  stage_projection = model_config.get("stage_projection", _MODEL_DEFAULTS["stage_projection"])
  if not isinstance(stage_projection, bool):
    raise ConfigError("model.stage_projection", stage_projection, "True or False")
  _check_input_statistics(model_config)


def _check_input_statistics(model_config):
  for field in ("input_mean", "input_std"):
    value = model_config.get(field, _MODEL_DEFAULTS[field])
    if len(value) != 3 or (field == "input_std" and min(value) <= 0):
      raise ConfigError(f"model.{field}", tuple(value),
                        "3 numbers (R, G, B)" + (", each > 0" if field == "input_std" else ""))


def _check_vit_config(model_config, image_size):
  heads = model_config.get("num_heads")
  if heads is not None and (not isinstance(heads, int) or heads <= 0):
    raise ConfigError("model.num_heads", heads, "an integer > 0, or None (the spec's)")
  heads = vit_heads(model_config)
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
  position = model_config.get("position_embedding", _MODEL_DEFAULTS["position_embedding"])
  if position not in vit.POSITION_EMBEDDINGS:
    raise ConfigError("model.position_embedding", position,
                      f"one of {list(vit.POSITION_EMBEDDINGS)}")
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
