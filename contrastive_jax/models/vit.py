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

DINOv2's backbones (Oquab et al. 2024, facebookresearch/dinov2
vision_transformer.py; registers: Darcet et al. 2024) are this ViT with options, each
off by default: layer scale (ls1 / ls2), register tokens, a learned position embedding
stored for a grid of its own and resized as DINOv2 resizes it (offset bicubic, or
antialiased bicubic for the _reg models), and ViT-g's SwiGLU MLP (recipes.DINOV2_MODELS).
DINOv3's (Simeoni et al. 2025, facebookresearch/dinov3 models/vision_transformer.py,
layers/) add: no position embedding added to the tokens but RoPE on the patches' queries and
keys (position_embedding 'rope': rope_sin_cos), 4 storage tokens where DINOv2's registers
go, a query-key-value bias whose key third is held at zero (mask_key_bias: the reference's
LinearKMaskedBias and its bias_mask) and LayerNorm eps 1e-5 (norm_epsilon;
recipes.DINOV3_MODELS).

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
# Large and Giant are DINOv2's (dinov2 vision_transformer.py: vit_large, vit_giant2, the
# latter 1536 wide with 24 heads of 64).
SPECS = {
  "vit_tiny": (192, 12, 3),
  "vit_small": (384, 12, 12),
  "vit_base": (768, 12, 12),
  "vit_large": (1024, 24, 16),
  "vit_giant": (1536, 40, 24),
}
# 'sincos': MoCo v3's fixed 2-D sine-cosine embedding, none on the class token (vits.py);
# 'learned': a learned [1 + grid^2, D] embedding added to the class token and the patches
# (timm's VisionTransformer, pos_embed, truncated normal std 0.02 there), resized to other
# grids as DINO's interpolate_pos_encoding.
# 'rope': none added; DINOv3's rotary embedding of the patches' queries and keys in every
# block (rope_sin_cos), for any grid.
POSITION_EMBEDDINGS = ("sincos", "learned", "rope")
# How a learned position embedding is resized to another grid (DINOv2's
# interpolate_pos_encoding): 'offset', bicubic with scale factor (grid + 0.1) / G (DINO's,
# DINOv2's models without registers); 'antialias', antialiased bicubic to the size grid
# (DINOv2's _reg models: interpolate_antialias=True, interpolate_offset=0).
POSITION_INTERPOLATIONS = ("offset", "antialias")
# The feed-forward network of a block: 'gelu', Linear GELU Linear (ratio 4); 'swiglu',
# DINOv2's SwiGLUFFNFused (ViT-g): w3(silu(a) * b) with [a, b] = w12(x).
MLPS = ("gelu", "swiglu")
FROZEN_PREFIX = "frozen_"  # Modules named so get no optimizer update (methods/optim.py).
LN_EPSILON = 1e-6
# DINOv3's RoPE (dinov3 layers/rope_position_encoding.py, its ViTs' pos_embed_rope_base).
ROPE_BASE = 100.0
# The value of each field a ViT config may leave out (MoCo v3's recipes do).
# MoCo v3's, DINO's and timm's ViTs have no layer scale, no register tokens, GELU MLPs.
_DEFAULTS = dict(
  position_embedding="sincos",
  position_interpolation="offset",
  position_grid=0,
  layer_scale=False,
  registers=0,
  mlp="gelu",
  mask_key_bias=False,
  norm_epsilon=LN_EPSILON,
)


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


def rope_periods(head_dim: int, base: float = ROPE_BASE) -> np.ndarray:
  """DINOv3's RoPE periods, float32 [head_dim / 4]: base^(2 i / (head_dim / 2)), i <
  head_dim / 4 (dinov3 layers/rope_position_encoding.py _init_weights with `base`; its
  checkpoints store them as rope_embed.periods)."""
  quarter = head_dim // 4
  return (base ** (2.0 * np.arange(quarter, dtype=np.float64) / (head_dim // 2))).astype(np.float32)


def rope_sin_cos(grid: int, head_dim: int) -> tuple:
  """DINOv3's RoPE of a grid x grid patch grid: (sin, cos), each float32 [grid^2, head_dim].

  As dinov3 RopePositionEmbedding.forward in evaluation, normalize_coords 'separate': the
  patch in row r and column c (row-major, as the convolution's output) sits at
  (y, x) = (2 (r + 0.5) / grid - 1, 2 (c + 0.5) / grid - 1) in [-1, 1]; its angles are
  2 pi y / periods followed by 2 pi x / periods (head_dim / 2), repeated twice
  (head_dim). The reference's training-time shift, jitter and rescale of the
  coordinates are not applied (it applies them only in training). Computed in float64.
  """
  coords = (np.arange(grid, dtype=np.float64) + 0.5) / grid * 2.0 - 1.0
  rows, cols = np.meshgrid(coords, coords, indexing="ij")
  yx = np.stack([rows.reshape(-1), cols.reshape(-1)], axis=1)  # [grid^2, 2]
  periods = rope_periods(head_dim).astype(np.float64)
  angles = 2.0 * np.pi * yx[:, :, None] / periods[None, None, :]
  angles = np.tile(angles.reshape(grid * grid, -1), 2)
  return np.sin(angles).astype(np.float32), np.cos(angles).astype(np.float32)


def apply_rope(x, sin, cos):
  """Rotates the last T tokens of x [N, T', H, hd] by (sin, cos) [T, hd] as dinov3's
  rope_apply (x cos + rotate_half(x) sin, rotate_half([a, b]) = [-b, a] on the last axis's
  halves), in float32; the first T' - T tokens (class and storage tokens) are kept. Returns
  x's dtype."""
  prefix = x.shape[1] - sin.shape[0]
  y = x[:, prefix:].astype(jnp.float32)
  a, b = jnp.split(y, 2, axis=-1)
  y = y * cos[:, None] + jnp.concatenate([-b, a], axis=-1) * sin[:, None]
  return jnp.concatenate([x[:, :prefix], y.astype(x.dtype)], axis=1)


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


def antialiased_bicubic_resize_matrix(in_size: int, out_size: int) -> np.ndarray:
  """float64 [out_size, in_size]: 1-D resizing as torch's F.interpolate(size=out_size,
  mode='bicubic', antialias=True, align_corners=False) computes it (PIL's filter).

  With s = in_size / out_size, output i is centred on c = s (i + 0.5) in input
  coordinates; the filter's support is 2 max(s, 1) input pixels, its weights the
  cubic convolution with a = -0.5 (not -0.75 as without antialiasing) at
  (j + 0.5 - c) / max(s, 1) for the inputs j in [int(c - support + 0.5),
  int(c + support + 0.5)) clipped to the image, normalised to sum 1 (no border
  repetition): torch's _compute_indices_weights_aa.
  """
  scale = in_size / out_size
  stretch = max(scale, 1.0)
  support = 2.0 * stretch
  out = np.zeros((out_size, in_size))
  for i in range(out_size):
    centre = scale * (i + 0.5)
    lo = max(int(centre - support + 0.5), 0)
    hi = min(int(centre + support + 0.5), in_size)
    x = np.abs((np.arange(lo, hi) + 0.5 - centre) / stretch)
    weights = np.where(
      x < 1,
      (1.5 * x - 2.5) * x * x + 1,
      np.where(x < 2, ((-0.5 * x + 2.5) * x - 4) * x + 2, 0.0),
    )
    out[i, lo:hi] = weights / weights.sum()
  return out


def interpolate_position_embedding(pos_embed, grid: int, method: str = "offset"):
  """The learned position embedding of a G x G patch grid resized to grid x grid.

  As DINOv2's interpolate_pos_encoding (facebookresearch/dinov2
  vision_transformer.py; DINO's for 'offset'): the class token's row kept, the
  patch rows as a G x G x D image resized on both axes, the same embedding when
  grid == G. method 'offset': bicubic interpolation with scale factor
  (grid + 0.1) / G (the reference's +0.1 against floating point error, which also
  sets the sampling positions: bicubic_resize_matrix); 'antialias': antialiased
  bicubic to grid x grid (antialiased_bicubic_resize_matrix).

  Args:
    pos_embed: float [1, 1 + G^2, D].
    grid: patches a side of the images it is for.
    method: a POSITION_INTERPOLATIONS name.
  Returns:
    [1, 1 + grid^2, D], pos_embed's dtype.
  """
  n, d = pos_embed.shape[1] - 1, pos_embed.shape[2]
  trained = int(round(n**0.5))
  if grid == trained:
    return pos_embed
  if method == "antialias":
    w = antialiased_bicubic_resize_matrix(trained, grid)
  else:
    w = bicubic_resize_matrix(trained, grid, (grid + 0.1) / trained)
  w = jnp.asarray(w, pos_embed.dtype)
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


class MaskedKeyBiasDense(nn.Module):
  """nn.Dense [.., D] -> [.., 3D] (parameters 'kernel' [D, 3D], 'bias' [3D]) whose bias's
  middle third, the keys', is multiplied by 0: dinov3 layers/attention.py's
  LinearKMaskedBias with the bias_mask its init_weights_vit sets (1, 0, 1 on the thirds)."""

  features: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", _qkv_init, (x.shape[-1], self.features), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
    third = self.features // 3
    mask = np.ones(self.features, np.float32)
    mask[third : 2 * third] = 0.0
    y = jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))
    return y + (bias * mask).astype(self.dtype)


class SelfAttention(nn.Module):
  """Multi-head self-attention, [N, T, D] -> [N, T, D]; logits and softmax in float32.

  rope: (sin, cos) [T_patches, head_dim] (rope_sin_cos), applied to the queries and keys of
  the last T_patches tokens (apply_rope), or None. mask_key_bias: qkv's key bias held at 0
  (MaskedKeyBiasDense).
  """

  num_heads: int
  dtype: Any = jnp.float32
  mask_key_bias: bool = False

  @nn.compact
  def __call__(self, x, rope=None):
    n, t, d = x.shape
    head_dim = d // self.num_heads
    if self.mask_key_bias:
      qkv = MaskedKeyBiasDense(3 * d, dtype=self.dtype, name="qkv")(x)
    else:
      qkv = nn.Dense(3 * d, dtype=self.dtype, kernel_init=_qkv_init, name="qkv")(x)
    q, k, v = jnp.moveaxis(qkv.reshape(n, t, 3, self.num_heads, head_dim), 2, 0)
    if rope is not None:
      q, k = apply_rope(q, *rope), apply_rope(k, *rope)
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


def swiglu_hidden(width: int) -> int:
  """The hidden width of DINOv2's SwiGLUFFNFused for D = width at MLP ratio 4: 2/3 of 4 D
  rounded up to a multiple of 8 (dinov2 layers/swiglu_ffn.py; 4096 for ViT-g's 1536)."""
  return (int(4 * width * 2 / 3) + 7) // 8 * 8


class Block(nn.Module):
  """Pre-norm Transformer block: x + MHSA(LN(x)), then x + MLP(LN(x)); in training with
  drop_rate > 0 each branch goes through drop_path, with keys of the 'drop_path' rng.

  layer_scale: each branch multiplied by a learned per-channel gamma [D] before the
  residual sum (CaiT's LayerScale as DINOv2's ls1 / ls2, initialised at 1e-5 as timm's
  DINOv2 models). mlp: an MLPS name. mask_key_bias: SelfAttention's. norm_epsilon: the
  LayerNorms' eps. rope: SelfAttention's, passed to __call__.
  """

  num_heads: int
  mlp_ratio: int = 4
  dtype: Any = jnp.float32
  drop_rate: float = 0.0
  layer_scale: bool = False
  mlp: str = "gelu"
  mask_key_bias: bool = False
  norm_epsilon: float = LN_EPSILON

  @nn.compact
  def __call__(self, x, train: bool = False, rope=None):
    d = x.shape[-1]
    norm = lambda name: nn.LayerNorm(epsilon=self.norm_epsilon, dtype=self.dtype, name=name)
    dense = lambda width, name: nn.Dense(
      width, dtype=self.dtype, name=name, kernel_init=nn.initializers.xavier_uniform()
    )
    dropped = lambda y: (
      drop_path(y, self.drop_rate, self.make_rng("drop_path"))
      if train and self.drop_rate > 0
      else y
    )
    scaled = lambda y, name: (
      y * self.param(name, nn.initializers.constant(1e-5), (d,), jnp.float32).astype(y.dtype)
      if self.layer_scale
      else y
    )
    attention = SelfAttention(self.num_heads, self.dtype, self.mask_key_bias, name="attn")
    y = attention(norm("norm1")(x), rope)
    x = x + dropped(scaled(y, "ls1"))
    if self.mlp == "swiglu":
      a, b = jnp.split(dense(2 * swiglu_hidden(d), "w12")(norm("norm2")(x)), 2, axis=-1)
      y = dense(d, "w3")(nn.silu(a) * b)
    else:
      y = dense(self.mlp_ratio * d, "fc1")(norm("norm2")(x))
      y = dense(d, "fc2")(nn.gelu(y, approximate=False))
    return x + dropped(scaled(y, "ls2"))


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
      any other grid (interpolate_position_embedding); 'rope' none, the blocks' RoPE.
    position_interpolation: a POSITION_INTERPOLATIONS name, how a learned embedding
      is resized.
    position_grid: the patch grid a learned embedding is a parameter for (DINOv2's
      37, trained at 518 px with patch 14); 0: the grid of the images the model is
      initialised on.
    layer_scale: ls1 / ls2 in every block (Block).
    registers: R learned register tokens [1, R, D] (Darcet et al. 2024, DINOv2's
      register_tokens; DINOv3's storage_tokens), inserted between the class token and the
      patches after the position embedding is added (they get none, nor RoPE) and
      dropped from the output.
    mlp: an MLPS name.
    mask_key_bias: the attention's key bias held at 0 (DINOv3's mask_k_bias).
    norm_epsilon: every LayerNorm's eps (DINOv3's 1e-5; LN_EPSILON otherwise).
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
  position_interpolation: str = "offset"
  position_grid: int = 0
  layer_scale: bool = False
  registers: int = 0
  mlp: str = "gelu"
  mask_key_bias: bool = False
  norm_epsilon: float = LN_EPSILON
  input_mean: Sequence[float] = (0.0, 0.0, 0.0)
  input_std: Sequence[float] = (1.0, 1.0, 1.0)
  drop_path_rate: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool):
    """Maps images [N, S, S, 3] (float, values in [0, 1]) to h [N, width] float32.

    train: stochastic depth on (drop_path_rate > 0); nothing else differs in training.
    The final LayerNorm's tokens, float32 [N, 1 + (S/p)^2, D] (class token and patches
    in row-major order, registers left out: DINOv2's x_norm_clstoken and
    x_norm_patchtokens), are sown as intermediates 'tokens' (apply with
    mutable=['intermediates'] to get them), and with registers theirs, float32 [N, R, D]
    (DINOv3's x_storage_tokens), as 'registers'.
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
        stored = self.position_grid or grid
        pos_embed = self.param(
          "pos_embed", nn.initializers.normal(0.02), (1, 1 + stored * stored, d), jnp.float32
        )
      pos_embed = interpolate_position_embedding(pos_embed, grid, self.position_interpolation)
      x = x + pos_embed.astype(self.dtype)
    r = self.registers
    if r:
      registers = self.param("register_tokens", nn.initializers.normal(1e-6), (1, r, d))
      registers = jnp.zeros_like(x[:, :1]) + registers.astype(self.dtype)
      x = jnp.concatenate([x[:, :1], registers, x[:, 1:]], axis=1)
    rope = None
    if self.position_embedding == "rope":
      rope = tuple(jnp.asarray(t) for t in rope_sin_cos(grid, d // self.num_heads))
    rates = np.linspace(0.0, self.drop_path_rate, self.depth)
    for i in range(self.depth):
      x = Block(
        self.num_heads,
        dtype=self.dtype,
        drop_rate=float(rates[i]),
        layer_scale=self.layer_scale,
        mlp=self.mlp,
        mask_key_bias=self.mask_key_bias,
        norm_epsilon=self.norm_epsilon,
        name=f"block{i}",
      )(x, train, rope)
    x = nn.LayerNorm(epsilon=self.norm_epsilon, dtype=self.dtype, name="norm")(x)
    if r:
      self.sow("intermediates", "registers", x[:, 1 : 1 + r].astype(jnp.float32))
      x = jnp.concatenate([x[:, :1], x[:, 1 + r :]], axis=1)
    self.sow("intermediates", "tokens", x.astype(jnp.float32))
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


def config_field(model_config, name: str):
  """model_config's field `name`, or its _DEFAULTS value when the config has none."""
  return model_config.get(name, _DEFAULTS[name])


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
      f"of 4 x {heads} heads (the 2-D sin-cos embedding splits D in 4, RoPE a head's)",
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
  for field, allowed in (
    ("position_embedding", POSITION_EMBEDDINGS),
    ("position_interpolation", POSITION_INTERPOLATIONS),
    ("mlp", MLPS),
  ):
    if config_field(model_config, field) not in allowed:
      raise ConfigError(
        f"model.{field}", config_field(model_config, field), f"one of {list(allowed)}"
      )
  for field in ("layer_scale", "mask_key_bias"):
    if not isinstance(config_field(model_config, field), bool):
      raise ConfigError(f"model.{field}", config_field(model_config, field), "True or False")
  epsilon = config_field(model_config, "norm_epsilon")
  if not isinstance(epsilon, float) or not 0 < epsilon < 1:
    raise ConfigError("model.norm_epsilon", epsilon, "a float in (0, 1) (the LayerNorms' eps)")

  for field, what in (
    ("registers", "register tokens"),
    ("position_grid", "patches a side of the learned embedding; 0: the image's grid"),
  ):
    value = config_field(model_config, field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise ConfigError(f"model.{field}", value, f"an integer >= 0 ({what})")
  if not isinstance(model_config.get("random_patch_projection"), bool):
    raise ConfigError(
      "model.random_patch_projection", model_config.get("random_patch_projection"), "True or False"
    )
  common.check_input_statistics(model_config)


def build_encoder(model_config, bn_axis_name=None) -> ViT:
  """The ViT of a checked config: fields name (SPECS), width, depth, patch_size, dtype,
  random_patch_projection, position_embedding, position_interpolation, position_grid,
  layer_scale, registers, mlp, mask_key_bias, norm_epsilon (each of these eight _DEFAULTS'
  when absent), num_heads, input_mean, input_std;
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
    position_embedding=config_field(model_config, "position_embedding"),
    position_interpolation=config_field(model_config, "position_interpolation"),
    position_grid=config_field(model_config, "position_grid"),
    layer_scale=config_field(model_config, "layer_scale"),
    registers=config_field(model_config, "registers"),
    mlp=config_field(model_config, "mlp"),
    mask_key_bias=config_field(model_config, "mask_key_bias"),
    norm_epsilon=config_field(model_config, "norm_epsilon"),
    input_mean=input_mean,
    input_std=input_std,
  )
