"""MLP heads (projection head, predictor) and the encoder + heads model, in Flax Linen.

The projection head maps h to z, which feeds the contrastive loss (SimCLR,
Chen et al. 2020, Sec. 2.1). Dense layers are initialised as Flax's/Haiku's
default (BYOL), normal(0, 0.01) (SimCLR's linear_layer) or PyTorch's
nn.Linear default (MoCo). Outputs are float32, so that similarity logits and
losses are computed in float32.
"""

import functools
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

DENSE_INITS = ("lecun_normal", "normal_0.01", "torch")


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
    key, shape, dtype, -bound, bound
  )
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
  name. Maps [N, D_in] to [N, out_dim] float32; out_dim None stops after the
  hidden layers ([N, hidden_dims[-1]]): the first layers of a pretrained head,
  named as the whole head names them (EncoderWithHeadLayers).
  """

  hidden_dims: Sequence[int]
  out_dim: Optional[int]
  use_bn: bool = True
  final_bn: bool = False
  final_bn_scale: bool = True
  final_bias: bool = True
  dense_init: str = "lecun_normal"
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None

  @nn.compact
  def __call__(self, x, train: bool):
    norm = functools.partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=0.9,
      epsilon=1e-5,
      dtype=self.dtype,
      axis_name=self.bn_axis_name if train else None,
    )
    for width in self.hidden_dims:
      kernel_init, bias_init = _dense_inits(self.dense_init, x.shape[-1])
      x = nn.Dense(
        width,
        use_bias=not self.use_bn,
        dtype=self.dtype,
        kernel_init=kernel_init,
        bias_init=bias_init,
      )(x)
      if self.use_bn:
        x = norm()(x)
      x = nn.relu(x)
    if self.out_dim is None:
      return x.astype(jnp.float32)
    kernel_init, bias_init = _dense_inits(self.dense_init, x.shape[-1])
    x = nn.Dense(
      self.out_dim,
      use_bias=self.final_bias and not self.final_bn,
      dtype=self.dtype,
      kernel_init=kernel_init,
      bias_init=bias_init,
    )(x)
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


class EncoderWithHeadLayers(nn.Module):
  """An encoder followed by the first hidden layers of its projection head (each Dense ->
  [BN ->] ReLU): the network SimCLR v2 fine-tunes (Chen et al. 2020b, Sec. 2: fine-tuning
  from the first layer of the projection head instead of from h).

  encoder: the ResNet or ViT; projector: an MLP with out_dim None. Named 'encoder' and
  'projector' as in ContrastiveModel, so that a pretraining run's variables of both load
  by name. Maps images [N, S, S, 3] to float32 [N, projector.hidden_dims[-1]].
  """

  encoder: nn.Module
  projector: nn.Module

  def __call__(self, x, train: bool):
    return self.projector(self.encoder(x, train=train), train=train)


class WeightNormDense(nn.Module):
  """Dense layer without bias, weight-normalised (Salimans and Kingma 2016): W = g v / ||v||.

  DINO's last layer (Caron et al. 2021, Sec. 3.1; dino vision_transformer.py DINOHead:
  nn.utils.weight_norm of an nn.Linear without bias, weight_g filled with 1). Each
  output unit's kernel column v[:, j] is divided by its L2 norm and multiplied by g_j.
  learn_scale False (the reference's norm_last_layer True) fixes g = 1, so every
  column has unit norm; True makes g [out_dim] a parameter (initialised to 1), named
  'g' so that the 'kernels' weight-decay mask decays it, as the reference's
  get_params_groups decays its 2-D weight_g. v is initialised as PyTorch's
  nn.Linear (U(+-1/sqrt(fan_in))), as the reference creates the layer after its
  head's trunc_normal initialisation. Maps float [N, D] to float32 [N, out_dim].
  """

  out_dim: int
  learn_scale: bool = False

  @nn.compact
  def __call__(self, x):
    kernel_init, _ = _dense_inits("torch", x.shape[-1])
    v = self.param("kernel", kernel_init, (x.shape[-1], self.out_dim), jnp.float32)
    w = v / jnp.linalg.norm(v, axis=0, keepdims=True)
    if self.learn_scale:
      w = w * self.param("g", nn.initializers.ones, (self.out_dim,), jnp.float32)
    return jnp.matmul(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)


class DINOHead(nn.Module):
  """DINO's projection head: MLP, L2 normalisation, weight-normalised last layer.

  Caron et al. 2021 (Sec. 3.1 and Appendix; dino vision_transformer.py DINOHead):
  num_layers Dense layers, hidden_dim wide, each but the last followed by [BN ->]
  GELU (exact), the last to bottleneck_dim; the bottleneck L2-normalised; then
  WeightNormDense to out_dim (named 'last_layer', which optim's
  freeze_last_layer_epochs holds still). Dense kernels normal(0, 0.02) (the
  reference's trunc_normal_ at +-2, i.e. +-100 std), biases zero; BN (use_bn,
  the reference's use_bn_in_head) global over bn_axis_name. Maps [N, D_in] to
  float32 [N, out_dim], the logits the DINO loss sharpens.
  """

  out_dim: int
  hidden_dim: int = 2048
  bottleneck_dim: int = 256
  num_layers: int = 3
  use_bn: bool = False
  norm_last_layer: bool = True
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None

  @nn.compact
  def __call__(self, x, train: bool):
    dense = functools.partial(nn.Dense, dtype=self.dtype, kernel_init=nn.initializers.normal(0.02))
    for _ in range(self.num_layers - 1):
      x = dense(self.hidden_dim)(x)
      if self.use_bn:
        x = nn.BatchNorm(
          use_running_average=not train,
          momentum=0.9,
          epsilon=1e-5,
          dtype=self.dtype,
          axis_name=self.bn_axis_name if train else None,
        )(x)
      x = nn.gelu(x, approximate=False)
    x = dense(self.bottleneck_dim)(x).astype(jnp.float32)
    x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    return WeightNormDense(self.out_dim, not self.norm_last_layer, name="last_layer")(x)
