"""Global BatchNorm across devices; model shapes for every config."""

from helpers import load_config
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from contrastive_jax import models
from contrastive_jax import recipes
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.methods import common
from contrastive_jax.methods import get_method
from contrastive_jax.models import vit

# Each model's dimension of h, from its paper: the last stage's channels of a ResNet (He et
# al. 2016, Table 1), the token width D of a ViT (DeiT-Ti, ViT-S and ViT-B).
H_DIMS = {
  "resnet10": 512,
  "resnet18": 512,
  "resnet34": 512,
  "resnet50": 2048,
  "vit_tiny": 192,
  "vit_small": 384,
  "vit_base": 768,
  "vit_large": 1024,
  "vit_giant": 1536,
}
# models.FAMILIES key -> a model config of the name given, at width 1.
FAMILY_CONFIGS = {
  "resnet": lambda name: recipes.model(name, "cifar", "float32", "simclr"),
  "vit": lambda name: recipes.vit_model(name, 16, "float32", False),
}


# A ResNet-10 (one block a stage: the fewest ops to compile) at 1/16 width (8 to 64 channels)
# with the CIFAR stem and a legacy config's fields.
SMALL_RESNET = dict(
  name="resnet10",
  width=0.0625,
  stem="cifar",
  zero_init_residual=True,
  conv_init="he_normal",
  padding="legacy",
  stage_projection=False,
  input_mean=(0.0, 0.0, 0.0),
  input_std=(1.0, 1.0, 1.0),
)


def _encoder(axis_name):
  cfg = ml_collections.ConfigDict(dict(SMALL_RESNET, dtype="float32"))
  return models.build_encoder(cfg, bn_axis_name=axis_name)


def test_every_family_owns_its_names_and_builds_each_model_at_its_width():
  names = [name for family in models.FAMILIES.values() for name in family.SPECS]
  assert len(names) == len(set(names)), f"a name in two families' SPECS: {sorted(names)}"
  assert sorted(names) == sorted(H_DIMS)
  assert set(FAMILY_CONFIGS) == set(models.FAMILIES)
  x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
  for key, family in models.FAMILIES.items():
    for name in family.SPECS:
      config = ml_collections.ConfigDict(FAMILY_CONFIGS[key](name))
      assert models.family(config) == key
      models.check_model_config(config, 32)
      encoder = models.build_encoder(config)
      init = lambda x: encoder.init(jax.random.PRNGKey(0), x, train=False)
      h = jax.eval_shape(lambda x: encoder.apply(init(x), x, train=False), x)
      assert h.shape == (2, H_DIMS[name]) == (2, models.encoder_width(config)), name
      assert h.dtype == jnp.float32
  with pytest.raises(
    ConfigError,
    match=r"config.model.name='resnet7': must be one of "
    r"\['resnet10', 'resnet18', 'resnet34', 'resnet50', 'vit_base', 'vit_giant', 'vit_large', "
    r"'vit_small', 'vit_tiny'\]",
  ):
    models.encoder_width(ml_collections.ConfigDict(dict(name="resnet7")))


def test_global_bn_equals_bn_on_the_whole_batch():
  mesh = mesh_lib.make_mesh()
  x = jnp.asarray(np.random.default_rng(0).uniform(size=(16, 8, 8, 3)), jnp.float32)
  # Jitted, as the tests' other model calls: one program, not one per op run eagerly.
  params, stats = jax.jit(lambda key: common.init_variables(_encoder(None), key, 8))(
    jax.random.PRNGKey(0)
  )

  def forward(model):
    def fn(x):
      h, upd = model.apply(
        {"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
      )
      return h, upd["batch_stats"]

    return fn

  h_ref, stats_ref = jax.jit(forward(_encoder(None)))(x)
  sharded = jax.jit(
    jax.shard_map(
      forward(_encoder(mesh_lib.DATA_AXIS)),
      mesh=mesh,
      in_specs=jax.P(mesh_lib.DATA_AXIS),
      out_specs=(jax.P(mesh_lib.DATA_AXIS), jax.P()),
    )
  )
  h, new_stats = sharded(jax.device_put(x, mesh_lib.batch_sharded(mesh)))
  np.testing.assert_allclose(h, h_ref, rtol=1e-4, atol=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), new_stats, stats_ref
  )
  # Per-device BN differs: the test would catch a missing axis_name.
  local = jax.jit(
    jax.shard_map(
      forward(_encoder(None)),
      mesh=mesh,
      in_specs=jax.P(mesh_lib.DATA_AXIS),
      out_specs=(jax.P(mesh_lib.DATA_AXIS), jax.P(mesh_lib.DATA_AXIS)),
    )
  )
  h_local, _ = local(jax.device_put(x, mesh_lib.batch_sharded(mesh)))
  assert not np.allclose(h_local, h_ref, atol=1e-3)


@pytest.mark.parametrize(
  "name,variant,image_size,h_dim",
  [
    ("simclr_cifar10", "", 32, 512),
    ("simclr_cifar10", "runlocal", 32, 128),
    ("simclr_imagenet", "", 224, 2048),
  ],
)
def test_config_builds_model_with_expected_shapes(name, variant, image_size, h_dim):
  config = load_config(name, variant)
  assert config.image_size == image_size
  model = get_method(config.method).build_model(config)
  x = jnp.zeros((2, image_size, image_size, 3))
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x, train=False))
  h, z = jax.eval_shape(lambda v: model.apply(v, x, train=False), variables)[:2]
  assert h.shape == (2, h_dim) and h.dtype == jnp.float32
  assert z.shape == (2, config.projector.out_dim) and z.dtype == jnp.float32
  assert models.encoder_width(config.model) == h_dim


def test_bfloat16_compute_keeps_float32_params_and_outputs():
  cfg = ml_collections.ConfigDict(dict(SMALL_RESNET, dtype="bfloat16"))
  model = models.build_encoder(cfg)
  params, stats = jax.jit(lambda key: common.init_variables(model, key, 8))(jax.random.PRNGKey(0))
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  out = jax.jit(model.apply, static_argnames="train")(
    {"params": params, "batch_stats": stats}, jnp.ones((2, 8, 8, 3)), train=False
  )
  assert out.dtype == jnp.float32


def reference_bicubic(image, scale):
  """torch's F.interpolate(image, scale_factor=scale, mode='bicubic', align_corners=False) in
  float64, pixel by pixel as its upsample_bicubic2d: image [H, W, C] -> [floor(H scale),
  floor(W scale), C]; A = -0.75; source x = (o + 0.5) / scale - 0.5; taps clamped."""

  def kernel(x):  # Keys' cubic convolution with A = -0.75, by |x|.
    a, x = -0.75, abs(x)
    if x <= 1:
      return (a + 2) * x**3 - (a + 3) * x**2 + 1
    if x < 2:
      return a * x**3 - 5 * a * x**2 + 8 * a * x - 4 * a
    return 0.0

  h, w = image.shape[:2]
  out = np.zeros((int(h * scale), int(w * scale), image.shape[2]))
  for oy in range(out.shape[0]):
    for ox in range(out.shape[1]):
      ry, rx = (oy + 0.5) / scale - 0.5, (ox + 0.5) / scale - 0.5
      iy, ix = int(np.floor(ry)), int(np.floor(rx))
      for dy in range(-1, 3):
        for dx in range(-1, 3):
          tap = image[min(max(iy + dy, 0), h - 1), min(max(ix + dx, 0), w - 1)]
          out[oy, ox] += kernel(ry - (iy + dy)) * kernel(rx - (ix + dx)) * tap
  return out


@pytest.mark.parametrize("trained,grid", [(4, 2), (14, 6), (4, 7)])
def test_position_embedding_interpolates_as_dinos_interpolate_pos_encoding(trained, grid):
  # ViT-S/16's 224 px grid to the 96 px local views' (14 -> 6), runlocal's (4 -> 2) and an
  # upsampling (4 -> 7, where the border taps are clamped).
  d = 8
  pos = np.random.default_rng(0).normal(size=(1, 1 + trained * trained, d)).astype(np.float32)
  out = np.asarray(vit.interpolate_position_embedding(jnp.asarray(pos), grid))
  assert out.shape == (1, 1 + grid * grid, d)
  np.testing.assert_array_equal(out[0, 0], pos[0, 0])  # The class token's row is kept.
  patches = pos[0, 1:].reshape(trained, trained, d).astype(np.float64)
  want = reference_bicubic(patches, (grid + 0.1) / trained)
  np.testing.assert_allclose(out[0, 1:].reshape(grid, grid, d), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(vit.interpolate_position_embedding(jnp.asarray(pos), trained), pos)


def test_learned_position_embedding_vit_takes_another_grid_with_it_interpolated():
  # Initialised on 32 px (grid 4 at patch 8), applied to 16 px views (grid 2): the same
  # as a ViT whose embedding is the interpolated one, applied at its own grid.
  cfg = ml_collections.ConfigDict(
    recipes.vit_model("vit_tiny", 8, "float32", random_patch_projection=False)
  )
  cfg.update(width=0.0625, depth=1, position_embedding="learned")
  vit_model = models.build_encoder(cfg)
  # Jitted: one program each, not one per op run eagerly.
  params, _ = jax.jit(lambda key: common.init_variables(vit_model, key, 32))(jax.random.PRNGKey(0))
  assert params["pos_embed"].shape == (1, 17, 12)
  x = jax.random.uniform(jax.random.PRNGKey(1), (2, 16, 16, 3))
  h = jax.jit(lambda p: vit_model.apply({"params": p}, x, train=False))(params)
  small = dict(params, pos_embed=vit.interpolate_position_embedding(params["pos_embed"], 2))
  assert small["pos_embed"].shape == (1, 5, 12)
  small_model = models.build_encoder(cfg)
  small_apply = jax.jit(lambda p: small_model.apply({"params": p}, x, train=False))
  np.testing.assert_allclose(h, small_apply(small), rtol=1e-6)
  # The embedding matters: the un-interpolated rows of a 2 x 2 grid give another h.
  cut = dict(params, pos_embed=params["pos_embed"][:, :5])
  assert np.abs(h - small_apply(cut)).max() > 1e-4
