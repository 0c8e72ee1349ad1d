"""DINOv3 weights in: the ViT with RoPE, storage tokens, layer scale, the masked key bias and
LayerNorm eps 1e-5 equals the reference's forward pass, from the reference's and timm's state
dicts, at the hub's image size and another; files of another kind are refused in one line.

The reference outputs are tests/reference_outputs/dinov3_vit_small.npz, made by
tests/reference_outputs/make_dinov3.py (DINOv3's forward transcribed on torch's functional
operations, checked there against timm's DINOv3 and, given a checkout, dinov3's own); with
torch installed the tests here also run it live, with timm's own initialisation of its stock
DINOv3 models.
"""

import functools
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from reference_outputs import make_dinov2
from reference_outputs import make_dinov3 as make

from contrastive_jax import models
from contrastive_jax import recipes
from contrastive_jax.core import tensor_files
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import WeightsError
from contrastive_jax.models import state_dicts
from contrastive_jax.models import vit

HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "timm"))
TOLERANCE = 1e-5  # Relative: max |t - t_ref| / max |t_ref|, float32.
FOLDER = os.path.dirname(os.path.abspath(make.__file__))
CASE = "dinov3_vit_small"


def _relative(value, ref):
  return float(np.max(np.abs(np.asarray(value) - ref)) / np.max(np.abs(ref)))


@functools.lru_cache(maxsize=None)
def _forward(config_json: str):
  """The jitted forward pass of the model config (as JSON): one compilation per config and
  image size for all the tests."""
  encoder = models.build_encoder(ml_collections.ConfigDict(json.loads(config_json)))

  def forward(variables, images):
    x = images.astype(jnp.float32) / 255.0
    h, state = encoder.apply(variables, x, train=False, mutable=["intermediates"])
    return state["intermediates"]["tokens"][0], state["intermediates"]["registers"][0], h

  return jax.jit(forward)


def _tokens(config, variables, images):
  """The final norm's class and patch tokens [N, 1 + grid^2, D], its storage tokens
  [N, 4, D] and h [N, D]."""
  out = _forward(json.dumps(config.to_dict(), sort_keys=True))(variables, images)
  return tuple(np.asarray(t) for t in out)


@pytest.fixture(scope="module")
def committed():
  return dict(np.load(os.path.join(FOLDER, f"{CASE}.npz")))


@pytest.fixture(scope="module")
def reference():
  return make.random_state_dict(CASE)


def _import(tensors, config=None, path="x"):
  return state_dicts.from_state_dict(
    tensors, path, config or make.model_config(CASE), make.SIZES[0]
  )


def _timm_names(tensors):
  """A DINOv3 state dict in timm's names, as timm eva.py's checkpoint_filter_fn converts it
  for vit_small_patch16_dinov3_qkvb: rope_embed.periods, bias_mask and mask_token dropped,
  storage_tokens -> reg_token, ls1 / ls2.gamma -> gamma_1 / gamma_2, qkv.bias split into
  q_bias and v_bias (the key third dropped)."""
  out = {}
  for name, value in tensors.items():
    if name.endswith((".periods", ".bias_mask", "mask_token")):
      continue
    if name.endswith("qkv.bias"):
      q, _, v = np.split(value, 3)
      out[name.replace("qkv.bias", "q_bias")], out[name.replace("qkv.bias", "v_bias")] = q, v
      continue
    name = name.replace("ls1.gamma", "gamma_1").replace("ls2.gamma", "gamma_2")
    out["reg_token" if name == "storage_tokens" else name] = value
  return out


@pytest.mark.parametrize("size", make.SIZES)
def test_tokens_equal_the_references_at_the_hubs_size_and_another(size, reference, committed):
  tokens, storage, h = _tokens(make.model_config(CASE), _import(reference), make.images(CASE, size))
  want = committed[f"tokens_{size}"]
  assert tokens.shape == want.shape == (2, 1 + (size // 16) ** 2, 384)
  assert _relative(tokens, want) < TOLERANCE
  assert _relative(storage, committed[f"storage_{size}"]) < TOLERANCE
  np.testing.assert_array_equal(h, tokens[:, 0])


def test_timms_names_give_the_same_tokens(reference, committed):
  variables = _import(_timm_names(reference))
  size = make.SIZES[1]
  tokens, storage, _ = _tokens(make.model_config(CASE), variables, make.images(CASE, size))
  assert _relative(tokens, committed[f"tokens_{size}"]) < TOLERANCE
  assert _relative(storage, committed[f"storage_{size}"]) < TOLERANCE


@pytest.mark.parametrize("fields", [dict(mask_key_bias=False), dict(position_embedding="learned")])
def test_each_dinov3_option_changes_the_tokens(fields, reference, committed):
  """What the reference outputs guard against: without the key-bias mask or without RoPE (a
  learned embedding of zeros), the same weights give other tokens. (DINOv2's LayerNorm eps
  1e-6 changes them by 3e-6 only: test_norm_epsilon_reaches_every_layer_norm.)"""
  config = make.model_config(CASE)
  variables = _import(reference)
  config.update(fields)
  size = make.SIZES[1]
  if fields.get("position_embedding") == "learned":
    variables["params"]["pos_embed"] = np.zeros((1, 1 + (size // 16) ** 2, 384), np.float32)
  tokens, _, _ = _tokens(config, variables, make.images(CASE, size))
  assert _relative(tokens, committed[f"tokens_{size}"]) > 1e-4


def test_norm_epsilon_reaches_every_layer_norm(reference):
  """The case's weights scaled by 1e-3, so that the tokens' variance is near eps: the output
  moves with norm_epsilon (1e-5 vs DINOv2's 1e-6)."""
  config = make.model_config(CASE)
  variables = jax.tree.map(lambda v: v * 1e-3, _import(reference))
  images = make.images(CASE, make.SIZES[1])
  h = _tokens(config, variables, images)[2]
  config.norm_epsilon = 1e-6
  assert _relative(_tokens(config, variables, images)[2], h) > 0.1


def test_rope_tables_are_dinov3s_by_hand():
  """Grid 2, head width 8: periods 100^(0/2), 100^(2/4) = 1, 10; the patches sit at -1/2 and
  1/2 on each axis; patch (0, 1)'s angles are 2 pi (y / periods, x / periods), twice."""
  np.testing.assert_allclose(vit.rope_periods(8), [1.0, 10.0], rtol=1e-7)
  np.testing.assert_allclose(vit.rope_periods(64)[[0, 15]], [1.0, 100 ** (30 / 32)], rtol=1e-6)
  sin, cos = vit.rope_sin_cos(2, 8)
  angles = 2 * np.pi * np.array([-0.5, -0.05, 0.5, 0.05] * 2)
  np.testing.assert_allclose(sin[1], np.sin(angles), atol=1e-7)
  np.testing.assert_allclose(cos[1], np.cos(angles), atol=1e-7)
  # rotate_half on the halves: [a, b] -> [-b, a]; the prefix tokens are kept.
  x = np.arange(2 * 3 * 1 * 8, dtype=np.float32).reshape(2, 3, 1, 8)
  got = np.asarray(vit.apply_rope(jnp.asarray(x), sin[:2], cos[:2]))
  np.testing.assert_array_equal(got[:, 0], x[:, 0])
  a, b = x[:, 1:, :, :4], x[:, 1:, :, 4:]
  want = x[:, 1:] * cos[:2, None] + np.concatenate([-b, a], -1) * sin[:2, None]
  np.testing.assert_allclose(got[:, 1:], want, rtol=1e-6, atol=1e-5)


def test_onnx_graph_gives_the_references_class_token(reference, committed):
  import onnxruntime  # pylint: disable=import-outside-toplevel

  from contrastive_jax.models import onnx_graph  # pylint: disable=import-outside-toplevel

  config, size = make.model_config(CASE), make.SIZES[1]
  tensors = state_dicts.to_state_dict(config, _import(reference), size)
  session = onnxruntime.InferenceSession(
    onnx_graph.build(config, tensors, size).SerializeToString(),
    providers=["CPUExecutionProvider"],
  )
  h = session.run([onnx_graph.H], {onnx_graph.INPUT: make.images(CASE, size)})[0]
  assert _relative(h, committed[f"tokens_{size}"][:, 0]) < TOLERANCE


def test_export_writes_dinov3s_state_dict(reference):
  """The export is DINOv3's layout: every tensor of the file, mask_token zeros, the fixed
  periods and bias masks as the config computes them."""
  exported = state_dicts.to_state_dict(make.model_config(CASE), _import(reference), 224)
  assert sorted(exported) == sorted(reference)
  for name, value in reference.items():
    if name == "mask_token":
      np.testing.assert_array_equal(exported[name], np.zeros_like(value))
    elif name == "rope_embed.periods":
      np.testing.assert_allclose(exported[name], value, rtol=1e-6)
    else:
      np.testing.assert_array_equal(exported[name], value)


def _set(name, value):
  return lambda tensors: {**tensors, name: np.asarray(value, np.float32)}


REFUSALS = [
  (None, dict(registers=0), "has a tensor 'storage_tokens' .*4 storage tokens: .*registers=4$"),
  (
    None,
    dict(mask_key_bias=False),
    r"has a tensor 'blocks.0.attn.qkv.bias_mask' .*masks its key bias: .*mask_key_bias=True$",
  ),
  (
    None,
    dict(name="vit_base", num_heads=12),
    r"tensor 'cls_token' has shape \[1, 1, 384\] where a vit_base \(D 768, depth 3, patch 16, "
    r"registers 4, layer_scale True, mlp 'gelu', position_embedding 'rope', mask_key_bias True\) "
    r"on 224 px images needs \[1, 1, 768\] \(and 47 more of other shapes: 'storage_tokens' "
    r"\[1, 4, 384\] for \[1, 4, 768\], 'patch_embed.proj.weight' \[384, 3, 16, 16\] for "
    r"\[768, 3, 16, 16\], \.\.\.\)$",
  ),
  (None, dict(depth=2), "has a tensor 'blocks.2.attn.proj.bias'"),
  (None, dict(patch_size=14), r"patch_embed.proj.weight' has shape \[384, 3, 16, 16\]"),
  (
    _set("rope_embed.periods", vit.rope_periods(64, 10000.0)),
    {},
    r"rope_embed.periods are not the RoPE periods of base 100 .*max difference",
  ),
  (
    _set("blocks.2.attn.qkv.bias_mask", np.ones(3 * 384)),
    {},
    r"blocks.2.attn.qkv.bias_mask is not DINOv3's key-bias mask",
  ),
]


@pytest.mark.parametrize("change,fields,message", REFUSALS)
def test_a_file_of_another_size_or_kind_is_refused_in_one_line(change, fields, message, reference):
  tensors = change(reference) if change else reference
  config = make.model_config(CASE)
  config.update(fields)
  with pytest.raises(WeightsError, match=message) as error:
    state_dicts.from_state_dict(tensors, "w.pth", config, make.SIZES[0])
  assert str(error.value).startswith("w.pth: ") and "\n" not in str(error.value)


def test_dinov3_and_dinov2_files_for_each_other_are_refused_naming_the_tensors(reference):
  """A DINOv3 file given as DINOv2 and the reverse, in the reference's and timm's names: one
  line naming the tensors that tell the families apart, with their shapes."""
  dinov2_config = make_dinov2.model_config("dinov2_vit_small_reg4")
  dinov2_config.depth = make.DEPTH
  dinov2 = {
    e.name: np.zeros(s, np.float32) for e, s in state_dicts.torch_shapes(dinov2_config, 112)
  }
  timm_dinov2 = {"reg_token" if k == "register_tokens" else k: v for k, v in dinov2.items()}
  timm_dinov2["pos_embed"] = timm_dinov2["pos_embed"][:, 1:]
  for dinov3, periods in ((reference, True), (_timm_names(reference), False)):
    with pytest.raises(WeightsError, match=r"has no tensor 'pos_embed'") as error:
      state_dicts.from_state_dict(dinov3, "w.pth", dinov2_config, 112)
    message = str(error.value)
    assert "it holds a DINOv3 ViT (storage_tokens [1, 4, 384]" in message
    assert ("rope_embed.periods [16]" in message) == periods
    assert message.endswith("configs/dinov3.py describes DINOv3's") and "\n" not in message
  for tensors in (dinov2, timm_dinov2):
    with pytest.raises(WeightsError, match=r"has no tensor 'storage_tokens'") as error:
      state_dicts.from_state_dict(tensors, "w.pth", make.model_config(CASE), 224)
    message = str(error.value)
    assert "a learned position embedding (pos_embed [1, 65, 384]; DINOv2's" in message
    assert message.endswith("configs/dinov2.py describes DINOv2's") and "\n" not in message


def test_an_image_size_that_is_not_a_multiple_of_the_patch_is_refused():
  models.check_model_config(make.model_config(CASE), 16 * 14)
  with pytest.raises(
    ConfigError, match=r"^config.model.patch_size=16: .*divides image_size \(226\)"
  ):
    models.check_model_config(make.model_config(CASE), 226)


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("mask_key_bias", 1, "True or False"),
    ("norm_epsilon", 0.0, r"a float in \(0, 1\)"),
    ("norm_epsilon", "1e-5", r"a float in \(0, 1\)"),
    ("position_embedding", "alibi", r"one of \['sincos', 'learned', 'rope'\]"),
  ],
)
def test_a_bad_field_is_refused_naming_it(field, value, message):
  config = ml_collections.ConfigDict({**make.CASES[CASE][0], field: value})
  with pytest.raises(ConfigError, match=f"^config.model.{field}={value!r}: must be {message}"):
    models.check_model_config(config)


@pytest.mark.parametrize("name", sorted(recipes.DINOV3_MODELS))
def test_dinov3_recipes_have_the_published_shapes(name):
  """Widths, depths and heads of dinov3's vits16 / vitb16 / vitl16 (hub/backbones.py), patch
  16, 4 storage tokens, 16 RoPE periods (head width 64), a masked key bias, no pos_embed,
  LayerNorm eps 1e-5."""
  config = ml_collections.ConfigDict(recipes.dinov3_model(name, "float32"))
  models.check_model_config(config, 224)
  want = {"vit_small": (384, 6, 12), "vit_base": (768, 12, 12), "vit_large": (1024, 16, 24)}
  d = models.encoder_width(config)
  assert (d, vit.num_heads(config), config.depth) == want[config.name]
  assert (config.registers, config.mask_key_bias, config.norm_epsilon) == (4, True, 1e-5)
  assert state_dicts.fixed_tensor("rope_embed.periods", config, 224).shape == (16,)


def test_configs_dinov3_reads_a_full_size_file_in_timms_names():
  """configs/dinov3.py's vit_small_patch16_dinov3 (12 blocks, no pos_embed) reads a file of it
  in timm's names (q_bias and v_bias, no key bias, no periods or masks) into the variables.
  (The reference's layout, fixed tensors included: test_export_writes_dinov3s_state_dict.)"""
  from helpers import load_config  # pylint: disable=import-outside-toplevel

  pretrained = load_config("dinov3", "model=vit_small_patch16_dinov3,dtype=float32,image_size=256")
  assert (pretrained.image_size, pretrained.eval_crop_fraction) == (256, 0.875)
  rng = np.random.default_rng(0)
  tensors = {
    entry.name: (rng.normal(size=shape) * 0.02).astype(np.float32)
    for entry, shape in state_dicts.torch_shapes(pretrained.model, 256)
  }
  assert "pos_embed" not in tensors and tensors["storage_tokens"].shape == (1, 4, 384)
  assert tensors["patch_embed.proj.weight"].shape == (384, 3, 16, 16)
  params = state_dicts.from_state_dict(_timm_names(tensors), "x", pretrained.model, 256)["params"]
  np.testing.assert_array_equal(params["register_tokens"], tensors["storage_tokens"])
  q, k, v = np.split(tensors["blocks.11.attn.qkv.bias"], 3)
  np.testing.assert_array_equal(
    params["block11"]["attn"]["qkv"]["bias"], np.concatenate([q, np.zeros_like(k), v])
  )


@pytest.fixture(scope="module")
def live_outputs(tmp_path_factory):
  """make_dinov3.py's outputs made now, with timm's own initialisations, in a process of its
  own (torch's triton crashes when imported after TensorFlow)."""
  folder = tmp_path_factory.mktemp("dinov3_outputs")
  root = os.path.dirname(os.path.dirname(FOLDER))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  subprocess.run(
    [sys.executable, make.__file__, str(folder), "--own-init"], check=True, env=env, timeout=600
  )
  return folder


@pytest.mark.skipif(not HAVE_TORCH, reason="needs the torch extra (torch, timm)")
def test_live_reference_agrees_with_committed_outputs_and_timms_own_init(live_outputs, committed):
  live = np.load(live_outputs / f"{CASE}.npz")
  for key, value in committed.items():
    assert _relative(live[key], value) < TOLERANCE
  own = np.load(live_outputs / f"{CASE}.own.npz")
  config, images = make.model_config(CASE), make.images(CASE, make.SIZES[0])
  for name in ("timm", *make.TIMM_MODELS):
    path = str(live_outputs / f"{CASE}.{name}.safetensors")
    variables = state_dicts.from_state_dict(tensor_files.read(path), path, config, make.SIZES[0])
    tokens, storage, _ = _tokens(config, variables, images)
    want = make.split_tokens(own[name])
    assert _relative(tokens, want[0]) < TOLERANCE
    assert _relative(storage, want[1]) < TOLERANCE
