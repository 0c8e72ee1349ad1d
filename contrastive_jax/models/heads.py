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
