"""Vision Transformer encoders (Dosovitskiy et al. 2021) as MoCo v3 trains them.

MoCo v3 (Chen, Xie and He 2021, arXiv 2104.02057, Sec. 4 and Appendix;
facebookresearch/moco-v3 vits.py on timm's VisionTransformer): non-overlapping
p x p patches projected to D dimensions by a strided convolution, a learned
class token prepended, a fixed 2-D sine-cosine position embedding added (none
on the class token), L pre-norm blocks x + MHSA(LN(x)), x + MLP(LN(x)) (MLP
ratio 4, exact GELU, LayerNorm eps 1e-6, qkv with bias), a final LayerNorm;
the representation h is the class token after it. No dropout, no BatchNorm, so
the encoder has no batch_stats; stochastic depth (drop_path_rate, off by default)
is DINO's student's.

Initialisation as vits.py: dense kernels Xavier-uniform (qkv's bound computed
as if q, k and v were three separate D x D matrices), biases zero, the patch
projection U(+-sqrt(6 / (3 p^2 + D))), the class token normal(0, 1e-6).

random_patch_projection is MoCo v3's stability trick (Sec. 4.2, vits.py's
stop_grad_conv1): the patch projection stays at its random initialisation.
Its parameters then live in a module named 'frozen_patch_embed', which
optim.build_optimizer(..., freeze=True) gives no update at all (no weight
decay either, as PyTorch skips a parameter with requires_grad False); the
forward pass stops the gradient too.

Precision: parameters float32; dense layers and the convolution compute in
`dtype` (bfloat16 on accelerators); LayerNorm statistics, attention logits
and softmax in float32; h float32.

Written here in Flax Linen: no maintained Flax ViT package offers the fixed
2-D sin-cos embedding, the frozen patch projection and this module's
parameter layout together (flax's examples and big_vision are not libraries
to depend on).

The family API of the model registry (models/__init__.py): SPECS, check_config,
build_encoder and encoder_width.
"""

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.models import common

# name -> (width D, depth, heads). Tiny is DeiT-Ti (Touvron et al. 2021, Table 1); Small
# and Base are MoCo v3's (vits.py): its ViT-S has 12 heads where DeiT-S has 6 (the
# parameters are the same, the attention finer).
SPECS = {
  "vit_tiny": (192, 12, 3),
  "vit_small": (384, 12, 12),
  "vit_base": (768, 12, 12),
}
# 'sincos': MoCo v3's fixed 2-D sine-cosine embedding, none on the class token (vits.py);
# 'learned': a learned [1 + grid^2, D] embedding added to the class token and the patches
# (timm's VisionTransformer, pos_embed, truncated normal std 0.02 there), resized to other
# grids as DINO's interpolate_pos_encoding.
POSITION_EMBEDDINGS = ("sincos", "learned")
FROZEN_PREFIX = "frozen_"  # Modules named so get no optimizer update (methods/optim.py).
LN_EPSILON = 1e-6
# The value of each field a ViT config may leave out (MoCo v3's recipes do).
_DEFAULTS = dict(position_embedding="sincos")


def sincos_position_embedding(grid: int, dim: int, temperature: float = 10000.0) -> np.ndarray:
  """Fixed 2-D sine-cosine position embedding of a grid x grid patch grid, float32 [grid^2, dim].

  As moco-v3 vits.py's build_2d_sincos_position_embedding: with
  omega_i = 1 / temperature^(i / (dim/4)), i < dim/4, the patch in row r and
  column c (patches flattened row-major, as the convolution's output) gets
    [sin(r omega), cos(r omega), sin(c omega), cos(c omega)].
  The reference names its first coordinate grid_w, but torch.meshgrid's
  'ij' indexing makes it the row index for flattened row-major patches; this
  function reproduces its values. The class token gets no embedding (zeros).

  Raises:
    ValueError: dim not a multiple of 4.
  """
  if dim % 4:
    raise ValueError(f"dim={dim}: the 2-D sin-cos embedding needs a multiple of 4")
  quarter = dim // 4
  omega = 1.0 / temperature ** (np.arange(quarter, dtype=np.float64) / quarter)
  rows, cols = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
  out_r = rows.reshape(-1)[:, None] * omega[None, :]
  out_c = cols.reshape(-1)[:, None] * omega[None, :]
  return np.concatenate(
    [np.sin(out_r), np.cos(out_r), np.sin(out_c), np.cos(out_c)], axis=1
  ).astype(np.float32)


def _cubic_weights(t: float, a: float = -0.75) -> np.ndarray:
  """The 4 weights of cubic convolution (Keys 1981) at fraction t in [0, 1] for the inputs
  at offsets -1, 0, 1, 2, with a = -0.75 as torch's bicubic interpolation."""

  def near(x):  # |x| <= 1
    return ((a + 2) * x - (a + 3)) * x * x + 1

  def far(x):  # 1 < |x| < 2
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

  return np.array([far(t + 1), near(t), near(1 - t), far(2 - t)])


def bicubic_resize_matrix(in_size: int, out_size: int, scale: float) -> np.ndarray:
  """float64 [out_size, in_size]: 1-D bicubic interpolation as a matrix, as torch's
  F.interpolate(mode='bicubic', align_corners=False, scale_factor=scale) computes it.

  Output i samples the input at x = (i + 0.5) / scale - 0.5 with the cubic
  convolution weights of _cubic_weights at t = x - floor(x) on floor(x) - 1 ...
  floor(x) + 2, indices clamped to [0, in_size - 1] (the border repeated), as
  torch's upsample_bicubic2d.
  """
  out = np.zeros((out_size, in_size))
  for i in range(out_size):
    x = (i + 0.5) / scale - 0.5
    x0 = int(np.floor(x))
    weights = _cubic_weights(x - x0)
    for offset, w in zip(range(-1, 3), weights):
      out[i, min(max(x0 + offset, 0), in_size - 1)] += w
  return out


def interpolate_position_embedding(pos_embed, grid: int):
  """The learned position embedding of a G x G patch grid resized to grid x grid.

  As DINO's interpolate_pos_encoding (facebookresearch/dino vision_transformer.py):
  the class token's row kept, the patch rows as a G x G x D image resized by
  bicubic interpolation with scale factor (grid + 0.1) / G on both axes (the
  reference's +0.1 against floating point error, which also sets the sampling
  positions: bicubic_resize_matrix), the same embedding when grid == G.

  Args:
    pos_embed: float [1, 1 + G^2, D].
    grid: patches a side of the images it is for.
  Returns:
    [1, 1 + grid^2, D], pos_embed's dtype.
  """
  n, d = pos_embed.shape[1] - 1, pos_embed.shape[2]
  trained = int(round(n**0.5))
  if grid == trained:
    return pos_embed
  w = jnp.asarray(bicubic_resize_matrix(trained, grid, (grid + 0.1) / trained), pos_embed.dtype)
  patches = pos_embed[0, 1:].reshape(trained, trained, d)
  patches = jnp.einsum("iy,jx,yxd->ijd", w, w, patches, precision=jax.lax.Precision.HIGHEST)
  return jnp.concatenate([pos_embed[:, :1], patches.reshape(1, grid * grid, d)], axis=1)


def _uniform(bound: float):
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def _qkv_init(key, shape, dtype=jnp.float32):
  """Xavier-uniform of a [D, 3D] kernel as three D x D matrices (vits.py)."""
  fan_in, fan_out = shape[0], shape[1] // 3
  return _uniform((6.0 / (fan_in + fan_out)) ** 0.5)(key, shape, dtype)


class SelfAttention(nn.Module):
  """Multi-head self-attention, [N, T, D] -> [N, T, D]; logits and softmax in float32."""

  num_heads: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    n, t, d = x.shape
    head_dim = d // self.num_heads
    qkv = nn.Dense(3 * d, dtype=self.dtype, kernel_init=_qkv_init, name="qkv")(x)
    q, k, v = jnp.moveaxis(qkv.reshape(n, t, 3, self.num_heads, head_dim), 2, 0)
    logits = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(logits / head_dim**0.5, axis=-1).astype(self.dtype)
    out = jnp.einsum("nhqk,nkhd->nqhd", weights, v).reshape(n, t, d)
    return nn.Dense(d, dtype=self.dtype, kernel_init=nn.initializers.xavier_uniform(), name="proj")(
      out
    )


def drop_path(x, rate: float, key):
  """Stochastic depth of a residual branch (Huang et al. 2016; DINO's vision_transformer.py
  drop_path): each sample's branch x[n] is zeroed with probability rate, else divided by
  1 - rate, so its expectation is x. x: [N, ...]; key: a PRNG key; rate in [0, 1)."""
  keep = jax.random.bernoulli(key, 1.0 - rate, (x.shape[0],) + (1,) * (x.ndim - 1))
  return x * (keep.astype(x.dtype) / jnp.asarray(1.0 - rate, x.dtype))


class Block(nn.Module):
  """Pre-norm Transformer block: x + MHSA(LN(x)), then x + MLP(LN(x)); in training with
  drop_rate > 0 each branch goes through drop_path, with keys of the 'drop_path' rng."""

  num_heads: int
  mlp_ratio: int = 4
  dtype: Any = jnp.float32
  drop_rate: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool = False):
    d = x.shape[-1]
    norm = lambda name: nn.LayerNorm(epsilon=LN_EPSILON, dtype=self.dtype, name=name)
    dense = lambda width, name: nn.Dense(
      width, dtype=self.dtype, name=name, kernel_init=nn.initializers.xavier_uniform()
    )
    dropped = lambda y: (
      drop_path(y, self.drop_rate, self.make_rng("drop_path"))
      if train and self.drop_rate > 0
      else y
    )
    x = x + dropped(SelfAttention(self.num_heads, self.dtype, name="attn")(norm("norm1")(x)))
    y = dense(self.mlp_ratio * d, "fc1")(norm("norm2")(x))
    return x + dropped(dense(d, "fc2")(nn.gelu(y, approximate=False)))


class ViT(nn.Module):
  """Vision Transformer encoder; see the module docstring.

  Attributes:
    width: D, the token dimension (a multiple of 4 and of num_heads).
    depth: number of blocks.
    num_heads: attention heads.
    patch_size: p; the image size must be a multiple of it.
    dtype: compute dtype.
    random_patch_projection: freeze the patch projection (MoCo v3 Sec. 4.2).
    position_embedding: a POSITION_EMBEDDINGS name; 'learned' is a parameter for
      the patch grid of the images the model is initialised on, interpolated to
      any other grid (interpolate_position_embedding).
    input_mean, input_std: per-channel (R, G, B) standardisation of the [0, 1] input.
    drop_path_rate: stochastic depth in training, block i's branches dropped with
      probability drop_path_rate * i / (depth - 1) (DINO's vision_transformer.py: a
      linspace from 0); > 0 needs a 'drop_path' rng in apply. Not a config field: DINO's
      student sets it (config.dino.drop_path_rate), every other network is built without.
  """

  width: int
  depth: int
  num_heads: int
  patch_size: int
  dtype: Any = jnp.float32
  random_patch_projection: bool = False
  position_embedding: str = "sincos"
  input_mean: Sequence[float] = (0.0, 0.0, 0.0)
  input_std: Sequence[float] = (1.0, 1.0, 1.0)
  drop_path_rate: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool):
    """Maps images [N, S, S, 3] (float, values in [0, 1]) to h [N, width] float32.

    train: stochastic depth on (drop_path_rate > 0); nothing else differs in training.
    """
    p, d = self.patch_size, self.width
    x = (x - jnp.asarray(self.input_mean, jnp.float32)) / jnp.asarray(self.input_std, jnp.float32)
    name = (FROZEN_PREFIX if self.random_patch_projection else "") + "patch_embed"
    x = nn.Conv(
      d,
      (p, p),
      strides=(p, p),
      padding="VALID",
      dtype=self.dtype,
      name=name,
      kernel_init=_uniform((6.0 / (3 * p * p + d)) ** 0.5),
    )(x.astype(self.dtype))
    if self.random_patch_projection:
      x = jax.lax.stop_gradient(x)
    n, grid = x.shape[0], x.shape[1]  # [N, S/p, S/p, D]
    x = x.reshape(n, grid * grid, d)
    if self.position_embedding == "sincos":
      x = x + sincos_position_embedding(grid, d).astype(self.dtype)
    cls = self.param("cls_token", nn.initializers.normal(1e-6), (1, 1, d), jnp.float32)
    # zeros_like keeps x's sharding (a replicated broadcast would not concatenate with
    # a batch-sharded x under explicit sharding).
    x = jnp.concatenate([jnp.zeros_like(x[:, :1]) + cls.astype(self.dtype), x], axis=1)
    if self.position_embedding == "learned":
      # Created for the grid of the images the model is initialised on; other grids
      # (multi-crop's local views, another resolution) get it interpolated.
      if self.has_variable("params", "pos_embed"):
        pos_embed = self.get_variable("params", "pos_embed")
      else:
        pos_embed = self.param(
          "pos_embed", nn.initializers.normal(0.02), (1, 1 + grid * grid, d), jnp.float32
        )
      x = x + interpolate_position_embedding(pos_embed, grid).astype(self.dtype)
    rates = np.linspace(0.0, self.drop_path_rate, self.depth)
    for i in range(self.depth):
      x = Block(self.num_heads, dtype=self.dtype, drop_rate=float(rates[i]), name=f"block{i}")(
        x, train
      )
    x = nn.LayerNorm(epsilon=LN_EPSILON, dtype=self.dtype, name="norm")(x)
    return x[:, 0].astype(jnp.float32)


def encoder_width(model_config) -> int:
  """D of a ViT config, the dimension of h: the spec's D times model.width, rounded (a
  runlocal shrinks it)."""
  return round(SPECS[model_config.name][0] * model_config.width)


def num_heads(model_config) -> int:
  """Attention heads of a ViT config: model.num_heads, or the spec's when unset (None).

  A checkpoint's shapes do not tell the heads (qkv is [D, 3D] whatever their
  number): timm's vit_small_patch16_224 has 6 where SPECS' vit_small has 12.
  """
  return model_config.get("num_heads") or SPECS[model_config.name][2]


def check_config(model_config, image_size: int = None):
  """Raises ConfigError naming the first field of a ViT config (name in SPECS) that cannot
  be built (on images of image_size pixels, when given: the patch size must divide it)."""
  heads = model_config.get("num_heads")
  if heads is not None and (not isinstance(heads, int) or heads <= 0):
    raise ConfigError("model.num_heads", heads, "an integer > 0, or None (the spec's)")
  heads = num_heads(model_config)
  if not model_config.width > 0 or encoder_width(model_config) % (4 * heads):
    raise ConfigError(
      "model.width",
      model_config.width,
      f"> 0, making D = {SPECS[model_config.name][0]} x width a multiple "
      f"of 4 x {heads} heads (the 2-D sin-cos embedding splits D in 4)",
    )
  if not isinstance(model_config.get("depth"), int) or model_config.depth <= 0:
    raise ConfigError("model.depth", model_config.get("depth"), "an integer > 0 (blocks)")
  patch = model_config.get("patch_size")
  if not isinstance(patch, int) or patch <= 0 or (image_size and image_size % patch):
    raise ConfigError(
      "model.patch_size",
      patch,
      "an integer > 0" + (f" that divides image_size ({image_size})" if image_size else ""),
    )
  position = model_config.get("position_embedding", _DEFAULTS["position_embedding"])
  if position not in POSITION_EMBEDDINGS:
    raise ConfigError("model.position_embedding", position, f"one of {list(POSITION_EMBEDDINGS)}")
  if not isinstance(model_config.get("random_patch_projection"), bool):
    raise ConfigError(
      "model.random_patch_projection", model_config.get("random_patch_projection"), "True or False"
    )
  common.check_input_statistics(model_config)


def build_encoder(model_config, bn_axis_name=None) -> ViT:
  """The ViT of a checked config: fields name (SPECS), width, depth, patch_size, dtype,
  random_patch_projection, position_embedding, num_heads, input_mean, input_std;
  D = encoder_width(model_config), num_heads(model_config) heads. bn_axis_name is
  accepted for the family API; a ViT has no BN."""
  del bn_axis_name
  input_mean, input_std = common.input_statistics(model_config)
  return ViT(
    encoder_width(model_config),
    model_config.depth,
    num_heads(model_config),
    model_config.patch_size,
    dtype=common.DTYPES[model_config.dtype],
    random_patch_projection=model_config.random_patch_projection,
    position_embedding=model_config.get("position_embedding", _DEFAULTS["position_embedding"]),
    input_mean=input_mean,
    input_std=input_std,
  )
