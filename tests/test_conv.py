"""models/conv.py: the matrix and patches lowerings against XLA's convolution and the views max-pool
against flax's, values and gradients, and the ResNet with them against the ResNet without."""

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from contrastive_jax import models
from contrastive_jax.models import conv

DIMENSIONS = ("NHWC", "HWIO", "NHWC")


def _numpy_conv(x, w, stride, pads):
  """The convolution's definition, sum over (i, j, c) of x_pad[n, s*y+i, s*x+j, c] w[i, j, c, o]
  (a negative pad crops)."""
  (top, bottom), (left, right) = pads
  x = np.pad(
    x.astype(np.float64), [(0, 0)] + [(max(lo, 0), max(hi, 0)) for lo, hi in pads] + [(0, 0)]
  )
  x = x[:, max(-top, 0) : x.shape[1] - max(-bottom, 0), max(-left, 0) : x.shape[2] - max(-right, 0)]
  kh, kw, _, o = w.shape
  ho, wo = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
  out = np.zeros((x.shape[0], ho, wo, o))
  for i in range(kh):
    for j in range(kw):
      window = x[:, i : i + (ho - 1) * stride + 1 : stride, j : j + (wo - 1) * stride + 1 : stride]
      out += window @ w[i, j].astype(np.float64)
  return out


@pytest.mark.parametrize(
  "side,cin,cout,kernel,stride,padding",
  [
    (5, 3, 4, 3, 1, "SAME"),
    (6, 3, 4, 3, 2, "SAME"),  # Even input, stride 2: 'SAME' pads after only.
    (6, 2, 5, 3, 2, ((1, 1), (1, 1))),
    (7, 2, 3, 7, 2, ((3, 3), (3, 3))),
    (4, 3, 2, 1, 2, "VALID"),
    (2, 4, 4, 3, 1, "SAME"),
    (1, 4, 6, 3, 1, "SAME"),
    (5, 2, 3, 3, 1, ((-1, 1), (1, -2))),  # A negative pad crops.
  ],
)
def test_patches_conv_equals_the_definition_and_xlas_convolution_with_gradients(
  side, cin, cout, kernel, stride, padding
):
  rng = np.random.default_rng(side * 100 + kernel)
  x = rng.normal(size=(3, side, side, cin)).astype(np.float32)
  w = rng.normal(size=(kernel, kernel, cin, cout)).astype(np.float32)
  strides = (stride, stride)
  pads = padding
  if isinstance(padding, str):
    pads = lax.padtype_to_pads((side, side), (kernel, kernel), strides, padding)
  got = conv.patches_conv(jnp.asarray(x), jnp.asarray(w), strides, padding, lax.Precision.HIGHEST)
  np.testing.assert_allclose(got, _numpy_conv(x, w, stride, pads), rtol=1e-5, atol=1e-5)

  def loss(fn):
    return lambda x, w: jnp.sum(jnp.sin(fn(x, w)))

  patches = loss(lambda x, w: conv.patches_conv(x, w, strides, padding, lax.Precision.HIGHEST))
  xla = loss(
    lambda x, w: lax.conv_general_dilated(
      x, w, strides, padding, dimension_numbers=DIMENSIONS, precision=lax.Precision.HIGHEST
    )
  )
  for got, want in zip(
    jax.grad(patches, argnums=(0, 1))(x, w), jax.grad(xla, argnums=(0, 1))(x, w)
  ):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
  "height,width,kernel,stride,padding",
  [
    (2, 2, (3, 3), 1, "SAME"),  # ResNet-18's stage 3 on 32 px through the ImageNet stem.
    (1, 1, (3, 3), 1, "SAME"),  # Stage 4: only the centre tap meets the input.
    (2, 2, (3, 3), 2, ((1, 1), (1, 1))),  # Stage 4's first convolution.
    (2, 3, (3, 3), 1, ((1, 0), (0, 2))),  # Uneven pads, a non-square map.
    (3, 3, (3, 3), 2, "VALID"),
    (2, 2, (3, 3), 1, ((-1, 2), (1, 1))),  # A negative pad crops.
    (2, 2, (2, 3), 1, "SAME"),  # Even kernel height.
  ],
)
def test_matrix_conv_equals_the_definition_and_xlas_convolution_with_gradients(
  height, width, kernel, stride, padding
):
  rng = np.random.default_rng(height * 10 + width)
  x = rng.normal(size=(3, height, width, 4)).astype(np.float32)
  w = rng.normal(size=(*kernel, 4, 5)).astype(np.float32)
  strides = (stride, stride)
  pads = conv.explicit_pads((height, width), kernel, strides, padding)
  assert conv.uses_matrix(x.shape, w.shape)
  got = conv.matrix_conv(jnp.asarray(x), jnp.asarray(w), stride, padding, lax.Precision.HIGHEST)
  np.testing.assert_allclose(got, _numpy_conv(x, w, stride, pads), rtol=1e-5, atol=1e-5)

  def loss(fn):
    return lambda x, w: jnp.sum(jnp.sin(fn(x, w, strides, padding, dimension_numbers=DIMENSIONS)))

  ours, xlas = loss(conv.conv_general_dilated), loss(lax.conv_general_dilated)
  jaxpr = jax.make_jaxpr(ours)(x, w)
  assert "conv_general_dilated" not in {e.primitive.name for e in jaxpr.jaxpr.eqns}
  for got, want in zip(jax.grad(ours, argnums=(0, 1))(x, w), jax.grad(xlas, argnums=(0, 1))(x, w)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  tangents = (x, w)
  np.testing.assert_allclose(
    jax.jvp(ours, (x, w), tangents)[1], jax.jvp(xlas, (x, w), tangents)[1], rtol=1e-4, atol=1e-4
  )


def test_matrix_conv_by_hand():
  """On a 1x1 map a 3x3 'SAME' convolution is the centre tap's product; on a 2x2 map of
  ones, output pixel (0, 0) sums the 2x2 taps at the kernel's bottom right."""
  w = jnp.arange(9.0).reshape(3, 3, 1, 1)
  one = conv.matrix_conv(jnp.full((1, 1, 1, 1), 2.0), w, 1, "SAME")
  np.testing.assert_array_equal(one, [[[[8.0]]]])
  out = conv.matrix_conv(jnp.ones((1, 2, 2, 1)), w, 1, "SAME")
  np.testing.assert_array_equal(
    out[0, :, :, 0], [[4 + 5 + 7 + 8, 3 + 4 + 6 + 7], [1 + 2 + 4 + 5, 0 + 1 + 3 + 4]]
  )


@pytest.mark.parametrize(
  "side,kernel,stride,padding",
  [
    (32, 7, 2, ((3, 3), (3, 3))),  # torchvision's stem.
    (32, 7, 2, "SAME"),  # Haiku's: pads (2, 3).
    (31, 7, 2, ((2, 3), (2, 3))),  # Odd input: the last row is cut.
    (17, 7, 3, "VALID"),
    (9, 8, 2, ((1, 0), (2, 1))),  # Even kernel, uneven pads.
  ],
)
def test_space_to_depth_conv_equals_the_definition_and_differentiates_as_xlas(
  side, kernel, stride, padding
):
  rng = np.random.default_rng(side + kernel)
  x = rng.normal(size=(3, side, side, 3)).astype(np.float32)
  w = rng.normal(size=(kernel, kernel, 3, 5)).astype(np.float32)
  strides = (stride, stride)
  pads = padding
  if isinstance(padding, str):
    pads = lax.padtype_to_pads((side, side), (kernel, kernel), strides, padding)
  got = conv.space_to_depth_conv(jnp.asarray(x), jnp.asarray(w), stride, padding, "highest")
  np.testing.assert_allclose(got, _numpy_conv(x, w, stride, pads), rtol=1e-5, atol=1e-4)

  def loss(fn):
    return lambda x, w: jnp.sum(jnp.sin(fn(x, w, strides, padding, dimension_numbers=DIMENSIONS)))

  assert conv.uses_space_to_depth(w.shape, strides)
  ours, xlas = loss(conv.conv_general_dilated), loss(lax.conv_general_dilated)
  np.testing.assert_allclose(ours(x, w), xlas(x, w), atol=1e-3)
  for got, want in zip(jax.grad(ours, argnums=(0, 1))(x, w), jax.grad(xlas, argnums=(0, 1))(x, w)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(want))))
  # Forward mode, and the weight gradient alone (the input's tangent a symbolic zero).
  tangents = (x, w)
  np.testing.assert_allclose(
    jax.jvp(ours, (x, w), tangents)[1], jax.jvp(xlas, (x, w), tangents)[1], rtol=1e-4
  )
  np.testing.assert_allclose(
    jax.grad(ours, argnums=1)(x, w), jax.grad(xlas, argnums=1)(x, w), rtol=1e-4, atol=1e-3
  )


def test_the_rule_and_what_keeps_xlas_convolution():
  assert conv.uses_patches((512, 8, 8, 16), (3, 3, 16, 32), (2, 2))
  assert not conv.uses_patches((512, 32, 32, 3), (7, 7, 3, 64), (2, 2))  # The stem.
  assert not conv.uses_patches((512, 8, 8, 16), (3, 3, 16, 16), (1, 1))
  assert conv.uses_patches((512, 2, 2, 64), (3, 3, 64, 64), (1, 1))
  assert conv.uses_matrix((512, 2, 2, 64), (3, 3, 64, 64))  # 4 pixels, 9 taps.
  assert conv.uses_matrix((512, 1, 1, 128), (3, 3, 128, 128))
  assert conv.uses_matrix((512, 3, 3, 8), (3, 3, 8, 8))
  assert not conv.uses_matrix((512, 4, 4, 32), (3, 3, 32, 32))  # 16 pixels.
  assert not conv.uses_matrix((512, 2, 2, 64), (1, 1, 64, 128))  # A shortcut: patches.
  assert not conv.uses_patches((512, 16, 16, 128), (3, 3, 128, 128), (1, 1))
  assert conv.uses_patches((512, 8, 8, 16), (1, 1, 16, 32), (2, 2))  # A shortcut.
  assert not conv.uses_patches((512, 8, 8, 256), (3, 3, 256, 512), (2, 2))  # Wide.
  assert not conv.uses_patches((512, 16, 16, 64), (3, 3, 64, 128), (2, 2))  # Large.
  assert not conv.uses_patches((512, 8, 8, 64), (3, 3, 64, 128), (2, 2))
  assert conv.uses_space_to_depth((7, 7, 3, 64), (2, 2))  # The ImageNet stem.
  assert not conv.uses_space_to_depth((3, 3, 16, 32), (2, 2))
  assert not conv.uses_space_to_depth((7, 7, 3, 64), (1, 1))
  assert not conv.uses_space_to_depth((7, 7, 3, 64), (2, 1))

  def primitives(padding="SAME", **kwargs):
    x, w = jnp.zeros((2, 2, 2, 4)), jnp.zeros((3, 3, 4, 4))
    fn = lambda x, w: conv.conv_general_dilated(
      x, w, (1, 1), padding, dimension_numbers=DIMENSIONS, **kwargs
    )
    return {e.primitive.name for e in jax.make_jaxpr(fn)(x, w).jaxpr.eqns}

  assert "conv_general_dilated" not in primitives()
  assert "conv_general_dilated" in primitives(rhs_dilation=(2, 2))
  # No output pixel (a 3x3 kernel on 2x2 pixels, unpadded): XLA's empty output.
  assert "conv_general_dilated" in primitives(padding="VALID")
  x, w = jnp.zeros((2, 2, 2, 4)), jnp.zeros((3, 3, 2, 4))
  grouped = jax.make_jaxpr(
    lambda x, w: conv.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=DIMENSIONS, feature_group_count=2
    )
  )(x, w)
  assert "conv_general_dilated" in {e.primitive.name for e in grouped.jaxpr.eqns}


def test_space_to_depth_leaves_negative_pads_and_sharded_spatial_axes_to_xla():
  x, w = np.ones((4, 16, 16, 3), np.float32), np.ones((7, 7, 3, 2), np.float32)

  def stem(pads):
    return lambda x: conv.conv_general_dilated(x, w, (2, 2), pads, dimension_numbers=DIMENSIONS)

  def custom(fn, x):
    return "custom_jvp_call" in {e.primitive.name for e in jax.make_jaxpr(fn)(x).jaxpr.eqns}

  assert custom(stem(((3, 3), (3, 3))), x)
  assert not custom(stem(((0, 0), (1, -3))), x)  # A negative pad in either pair.
  assert not custom(stem(((1, -3), (0, 0))), x)
  # Rows sharded over 4 devices: XLA's convolution, which takes them (space-to-depth's pad
  # of a sharded axis would not); a sharded batch keeps space-to-depth.
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  pads = ((3, 3), (3, 3))
  want = lax.conv_general_dilated(x, w, (2, 2), pads, dimension_numbers=DIMENSIONS)
  for spec, space_to_depth in ((jax.P(None, "data"), False), (jax.P("data"), True)):
    sharded = jax.device_put(x, jax.NamedSharding(mesh, spec))
    with jax.sharding.set_mesh(mesh):
      assert custom(stem(pads), sharded) == space_to_depth
      np.testing.assert_allclose(jax.jit(stem(pads))(sharded), want, rtol=1e-5)


def test_the_resnet_with_the_patches_lowering_equals_it_without(monkeypatch):
  """ResNet-18 at width 1/16 on 32 px (maps 8 to 1 px: the strided and small-map
  lowerings)."""
  config = ml_collections.ConfigDict(
    dict(
      name="resnet18",
      width=0.0625,
      stem="imagenet",
      dtype="float32",
      zero_init_residual=True,
      conv_init="he_normal",
      padding="torchvision",
      stage_projection=False,
      input_mean=(0.0, 0.0, 0.0),
      input_std=(1.0, 1.0, 1.0),
    )
  )
  encoder = models.build_encoder(config)
  x = jnp.asarray(np.random.default_rng(0).uniform(size=(4, 32, 32, 3)), jnp.float32)
  variables = encoder.init(jax.random.key(0), x, train=False)

  def features(params):
    h, _ = encoder.apply({**variables, "params": params}, x, train=True, mutable=["batch_stats"])
    return h

  def features_and_grads():
    """(h, d sum(h^2) / d params) as one program, jitted anew: traced with the lowerings of
    the moment (one compile, not one per operation)."""
    loss = lambda params: jnp.sum(jnp.square(features(params)))
    return jax.jit(lambda params: (features(params), jax.grad(loss)(params)))(variables["params"])

  h, grads = features_and_grads()
  monkeypatch.setattr(conv, "conv_general_dilated", lax.conv_general_dilated)
  monkeypatch.setattr(conv, "max_pool", lambda x, w, s, p: nn.max_pool(x, w, strides=s, padding=p))
  want_h, want_grads = features_and_grads()
  np.testing.assert_allclose(h, want_h, rtol=1e-4, atol=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * float(np.max(np.abs(b)))),
    grads,
    want_grads,
  )


@pytest.mark.parametrize(
  "shape,padding",
  [
    ((3, 9, 9, 2), "SAME"),
    ((3, 8, 8, 2), "SAME"),  # Even input, stride 2: 'SAME' pads after only.
    ((2, 8, 7, 3), ((1, 1), (1, 1))),  # torchvision's MaxPool2d(3, 2, padding=1).
    ((2, 9, 9, 1), "VALID"),
  ],
)
def test_max_pool_equals_flaxs_with_its_gradient_to_each_windows_first_maximum(shape, padding):
  rng = np.random.default_rng(sum(shape))
  # Rounded values: ties within windows, whose gradient XLA gives to the first maximum.
  x = jnp.asarray(np.round(rng.normal(size=shape)), jnp.float32)
  want = nn.max_pool(x, (3, 3), strides=(2, 2), padding=padding)
  got = conv.max_pool(x, (3, 3), (2, 2), padding)
  np.testing.assert_array_equal(got, want)
  # Integer cotangents: a pixel under several windows sums theirs exactly in any order.
  g = jnp.asarray(rng.integers(-4, 5, size=want.shape), jnp.float32)
  grad = lambda pool: jax.grad(lambda x: jnp.sum(pool(x) * g))(x)
  np.testing.assert_array_equal(
    grad(lambda x: conv.max_pool(x, (3, 3), (2, 2), padding)),
    grad(lambda x: nn.max_pool(x, (3, 3), strides=(2, 2), padding=padding)),
  )
  # Forward mode too: the tangent of each window's first maximum.
  t = jnp.asarray(rng.integers(-4, 5, size=shape), jnp.float32)
  jvp = lambda pool: jax.jvp(pool, (x,), (t,))[1]
  np.testing.assert_array_equal(
    jvp(lambda x: conv.max_pool(x, (3, 3), (2, 2), padding)),
    jvp(lambda x: nn.max_pool(x, (3, 3), strides=(2, 2), padding=padding)),
  )


@pytest.mark.parametrize(
  "shape,window,strides,padding",
  [
    ((1, 2, 2, 1), (3, 3), (2, 2), "VALID"),  # A window wider than the input: no output.
    ((1, 3, 3, 1), (2, 2), (1, 1), ((-1, 0), (0, 0))),  # Negative padding crops.
    ((2, 5, 6, 2), (2, 3), (1, 2), "SAME"),
  ],
)
def test_max_pool_of_other_windows_and_paddings_equals_flaxs(shape, window, strides, padding):
  x = jnp.asarray(np.random.default_rng(1).normal(size=shape), jnp.float32)
  want = nn.max_pool(x, window, strides=strides, padding=padding)
  np.testing.assert_array_equal(conv.max_pool(x, window, strides, padding), want)


def test_max_pool_gradient_by_hand():
  """A 3x3 window over 3x3 zeros with one 1: all the gradient to the 1; over all zeros:
  to the first."""
  one = jnp.zeros((1, 3, 3, 1)).at[0, 2, 1, 0].set(1.0)
  for x, at in ((one, (2, 1)), (jnp.zeros((1, 3, 3, 1)), (0, 0))):
    grad = jax.grad(lambda x: 5.0 * jnp.sum(conv.max_pool(x, (3, 3), (2, 2), "VALID")))(x)
    want = np.zeros((3, 3))
    want[at] = 5.0
    np.testing.assert_array_equal(grad[0, :, :, 0], want)


def test_the_cpu_tweaks_switch_off_leaves_xlas_convolution_and_flaxs_max_pool(monkeypatch):
  """CONTRASTIVE_JAX_CPU_TWEAKS=0 (core/runtime.py): the program of each shape that takes a
  lowering (matrix, patches, space-to-depth) is lax.conv_general_dilated's own, and the
  max-pool's flax's."""
  shapes = [
    ((2, 2, 2, 4), (3, 3, 4, 4), (1, 1), "SAME"),  # Matrix.
    ((2, 8, 8, 4), (3, 3, 4, 8), (2, 2), ((1, 1), (1, 1))),  # Patches.
    ((2, 16, 16, 3), (7, 7, 3, 4), (2, 2), ((3, 3), (3, 3))),  # Space-to-depth.
  ]

  def programs():
    found = []
    for lhs, rhs, strides, padding in shapes:
      x, w = jnp.zeros(lhs), jnp.zeros(rhs)
      ours = lambda x, w: conv.conv_general_dilated(
        x, w, strides, padding, dimension_numbers=DIMENSIONS
      )
      xlas = lambda x, w: lax.conv_general_dilated(
        x, w, strides, padding, dimension_numbers=DIMENSIONS
      )
      found.append(str(jax.make_jaxpr(ours)(x, w)) == str(jax.make_jaxpr(xlas)(x, w)))
    x = jnp.zeros((2, 9, 9, 2))
    pool = jax.make_jaxpr(lambda x: conv.max_pool(x, (3, 3), (2, 2), "SAME"))(x)
    flaxs = jax.make_jaxpr(lambda x: nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME"))(x)
    return found + [str(pool) == str(flaxs)]

  monkeypatch.delenv("CONTRASTIVE_JAX_CPU_TWEAKS", raising=False)
  assert programs() == [False] * 4
  monkeypatch.setenv("CONTRASTIVE_JAX_CPU_TWEAKS", "0")
  assert programs() == [True] * 4
