"""benchmarks/capacity.py's plan against independent references, on a tiny SimCLR config
(ResNet-10 at width 0.0625, 32x32 images) compiled for 2 of the 8 test devices."""

import math

from helpers import load_benchmark
from helpers import load_config
import jax
import jax.numpy as jnp
import pytest

from contrastive_jax.jobs import pretrain
from contrastive_jax.methods import get_method
from contrastive_jax.methods import pretraining

capacity = load_benchmark("capacity")
DEVICES = 2


def _without_photometric(config):
  """config's views keep their crops and flips only, as tests/helpers.tiny_config's: the
  colour jitter, grayscale, blur and solarisation compile to about as much as the tiny
  network's step, and the plan's numbers checked here do not depend on them (their FLOPs are
  per image, like the network's)."""
  for view in list(config.augment):
    config.augment[view] = dict(
      color_jitter_prob=0.0, grayscale_prob=0.0, blur_prob=0.0, solarize_prob=0.0
    )
  return config


def _config(batch_size):
  config = load_config("simclr_cifar10", "runlocal")
  config.model.name, config.model.width = "resnet10", 0.0625
  config.batch_size = batch_size
  return _without_photometric(config)


@pytest.fixture(scope="module")
def plan16():
  return capacity.plan(_config(16), DEVICES)


def test_parameter_bytes_are_the_param_tree_in_float32(plan16):
  config = _config(16)
  model = get_method(config.method).build_model(config)
  variables = jax.eval_shape(
    lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((2, 32, 32, 3), jnp.float32), train=False)
  )
  leaves = jax.tree.leaves(variables["params"])
  assert all(leaf.dtype == jnp.float32 for leaf in leaves)
  assert plan16.state_bytes["params"] == 4 * sum(math.prod(leaf.shape) for leaf in leaves)
  assert plan16.state_bytes["extra"] == 0  # SimCLR keeps no method state.


def test_compiled_arguments_are_the_replicated_state_and_a_batch_shard(plan16):
  per_device = 16 // DEVICES
  batch_shard = per_device * 2 * 32 * 32 * 3 + per_device * 4  # uint8 images, int32 labels.
  assert plan16.batch_bytes == batch_shard
  assert plan16.memory["argument"] == plan16.state_bytes["total"] + batch_shard
  # The state is donated: the new state is written into its buffers.
  assert plan16.memory["alias"] == plan16.state_bytes["total"]
  assert plan16.hbm_needed > plan16.memory["argument"]


def test_flops_positive_and_about_linear_in_the_batch(plan16):
  plan32 = capacity.plan(_config(32), DEVICES)
  assert plan16.flops > 0 and plan16.bytes_accessed > 0
  # Per-example work dominates; the optimizer update and the NT-Xent logits do not scale by 2.
  assert 1.7 < plan32.flops / plan16.flops < 2.3
  assert plan32.per_device_batch == 2 * plan16.per_device_batch


def test_estimate_is_the_slower_bound_and_fit_flips_at_the_needed_bytes(plan16):
  acc = capacity.ACCELERATORS["tpu_v5e"]
  e = capacity.estimate(plan16, acc, mfu=0.5)
  assert e.compute_seconds == pytest.approx(plan16.flops / (acc.peak_bf16_flops * 0.5))
  assert e.memory_seconds == pytest.approx(plan16.bytes_accessed / acc.hbm_bandwidth)
  assert e.step_seconds == max(e.compute_seconds, e.memory_seconds)
  assert e.images_per_second == pytest.approx(16 / e.step_seconds)
  assert e.hours == pytest.approx(plan16.num_steps * e.step_seconds / 3600)
  assert e.fits
  assert capacity.estimate(plan16, acc, 0.5, hbm_bytes=plan16.hbm_needed).fits
  assert not capacity.estimate(plan16, acc, 0.5, hbm_bytes=plan16.hbm_needed - 1).fits
  assert "| tpu_v5e |" in capacity.report(plan16, {"tpu_v5e": acc}, 0.5)


@pytest.mark.parametrize("variant", ["vit_small", "vit_base", "resnet50"])
def test_mocov3_imagenet_configs_pass_their_checks_and_build_their_state(variant):
  # The shapes part of the plan, from the jitted init's eval_shape as plan() takes it;
  # the compile, for the memory, is the README's table (21 to 52 s per config here).
  config = load_config("mocov3_imagenet", variant)
  pretrain.check_config(config, 8)
  get_method(config.method).check_config(config, capacity.KNOWN_DATASETS["imagenet2012"][0])
  mesh = jax.make_mesh((8,), ("data",))
  state = jax.eval_shape(pretraining.setup(config, mesh, 312, 300 * 312, num_classes=1000).init)
  nbytes = capacity.per_device_bytes
  params = state.params
  # timm's vit_small/base_patch16_224 (22,050,664 and 86,567,656 parameters) less their
  # 1000-class head and position embedding (a constant here); torchvision's resnet50
  # (25,557,032) less its fc.
  assert (
    sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params["encoder"]))
    == {"vit_small": 21_590_016, "vit_base": 85_647_360, "resnet50": 23_508_032}[variant]
  )
  # The momentum network (encoder and projector, no queue) and the optimizer's moments:
  # AdamW's two of every trained parameter (none for the frozen patch projection),
  # LARS's one.
  assert nbytes(state.extra) == (
    nbytes(params["encoder"])
    + nbytes(params["projector"])
    + nbytes(state.batch_stats.get("encoder", {}))
    + nbytes(state.batch_stats["projector"])
  )
  frozen = nbytes(params["encoder"].get("frozen_patch_embed", {}))
  moments = 2 * (nbytes(params) - frozen) if variant.startswith("vit") else nbytes(params)
  assert 0 <= nbytes(state.opt_state) - moments <= 64  # Step counters.


@pytest.mark.parametrize("variant", ["vit_small", "vit_small_300ep", "resnet50"])
def test_dino_imagenet_configs_pass_their_checks_and_build_their_state(variant):
  config = load_config("dino_imagenet", variant)
  pretrain.check_config(config, 8)
  get_method(config.method).check_config(config, capacity.KNOWN_DATASETS["imagenet2012"][0])
  mesh = jax.make_mesh((8,), ("data",))
  state = jax.eval_shape(pretraining.setup(config, mesh, 312, 100 * 312, num_classes=1000).init)
  nbytes = capacity.per_device_bytes
  count = lambda tree: sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))
  params = state.params
  # DINO's vit_small (timm's vit_small_patch16_224, 22,050,664 parameters, less its
  # 1000-class head: its learned position embedding included) and torchvision's resnet50
  # less its fc.
  assert count(params["encoder"]) == {"vit": 21_665_664, "res": 23_508_032}[variant[:3]]
  # DINOHead: Linear(D, 2048), Linear(2048, 2048), Linear(2048, 256) with biases, then the
  # last layer's weight_v [65536, 256], and its weight_g [65536] trained only without
  # norm_last_layer.
  d = {"vit": 384, "res": 2048}[variant[:3]]
  mlp = d * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 256 + 256
  g = 0 if config.dino.norm_last_layer else 65536
  assert count(params["projector"]) == mlp + 256 * 65536 + g
  # The teacher is a copy of the student (encoder and head, with their BN statistics),
  # the centre one float32 of each output.
  assert nbytes(state.extra) == nbytes(params) + nbytes(state.batch_stats) + 65536 * 4


def test_dino_multi_crop_plan_compiles_with_its_local_views_in_the_batch():
  config = _without_photometric(load_config("dino_cifar10", "runlocal_resnet,local_crops=2"))
  config.model.name, config.model.width = "resnet10", 0.0625
  config.batch_size = 16
  config.dino.update(out_dim=64, hidden_dim=32, bottleneck_dim=16)
  plan = capacity.plan(config, DEVICES)
  per_device = 16 // DEVICES
  views = 2 * 32 * 32 * 3 + 2 * 16 * 16 * 3  # Two global views of 32 px, two local of 16 px.
  assert plan.batch_bytes == per_device * views + per_device * 4
  assert plan.memory["argument"] == plan.state_bytes["total"] + plan.batch_bytes
  # The teacher (encoder and head) and the centre: the method's state.
  assert plan.extra_bytes["center"] == 64 * 4
  assert plan.extra_bytes["teacher_params"] == plan.state_bytes["params"]
  assert plan.flops > 0
