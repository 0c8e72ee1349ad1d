"""DINOv2 weights in: the ViT with layer scale, registers, patch 14 and DINOv2's
position-embedding interpolation equals the reference's forward pass, from the
reference's and timm's state dicts; files of another kind are refused in one line.

The reference outputs are tests/reference_outputs/dinov2_*.npz, made by
tests/reference_outputs/make_dinov2.py (DINOv2's forward transcribed on timm's
blocks); with torch installed the tests here also run it live, with timm's own
initialisation of its stock DINOv2 models.
"""

import importlib.util
import os
import subprocess
import sys

from helpers import reference_state_dict
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from reference_outputs import make_dinov2 as make

from contrastive_jax import models
from contrastive_jax import recipes
from contrastive_jax.core import tensor_files
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import WeightsError
from contrastive_jax.models import onnx_graph
from contrastive_jax.models import state_dicts
from contrastive_jax.models import vit

HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "timm"))
TOLERANCE = 1e-5  # Relative: max |t - t_ref| / max |t_ref|, float32 (1.6e-6 measured).
FOLDER = os.path.dirname(os.path.abspath(make.__file__))


def _relative(value, ref):
  return float(np.max(np.abs(np.asarray(value) - ref)) / np.max(np.abs(ref)))


def _tokens(config, variables, images):
  """The final norm's class and patch tokens [N, 1 + grid^2, D] and h [N, D]."""
  encoder = models.build_encoder(config)
  x = jnp.asarray(images, jnp.float32) / 255.0
  h, state = encoder.apply(variables, x, train=False, mutable=["intermediates"])
  return np.asarray(state["intermediates"]["tokens"][0]), np.asarray(h)


def _committed(case, size):
  return np.load(os.path.join(FOLDER, f"{case}.npz"))[f"tokens_{size}"]


def _import(tensors, case, path="x"):
  return state_dicts.from_state_dict(tensors, path, make.model_config(case), make.SIZES[0])


def _timm_names(case, tensors):
  """A DINOv2 state dict in timm's names, as timm's checkpoint_filter_fn converts it
  (vision_transformer.py _convert_dinov2): mask_token dropped; with registers, reg_token,
  and the class token's position embedding added to cls_token, removed from pos_embed."""
  out = {k: v for k, v in tensors.items() if k != "mask_token"}
  if "register_tokens" in out:
    out["reg_token"] = out.pop("register_tokens")
    out["cls_token"] = out["cls_token"] + out["pos_embed"][:, :1]
    out["pos_embed"] = out["pos_embed"][:, 1:]
  return out


@pytest.mark.parametrize("size", make.SIZES)
@pytest.mark.parametrize("case", list(make.CASES))
def test_tokens_equal_the_references_at_its_size_and_interpolated(case, size):
  variables = _import(reference_state_dict(make, case), case)
  tokens, h = _tokens(make.model_config(case), variables, make.images(case, size))
  want = _committed(case, size)
  assert tokens.shape == want.shape == (2, 1 + (size // 14) ** 2, 384)
  assert _relative(tokens, want) < TOLERANCE
  np.testing.assert_array_equal(h, tokens[:, 0])


@pytest.mark.parametrize("case", list(make.CASES))
def test_timms_names_give_the_same_tokens(case):
  tensors = _timm_names(case, reference_state_dict(make, case))
  variables = _import(tensors, case)
  for size in make.SIZES[:2]:
    tokens, _ = _tokens(make.model_config(case), variables, make.images(case, size))
    assert _relative(tokens, _committed(case, size)) < TOLERANCE


@pytest.mark.parametrize("case", list(make.CASES))
def test_the_other_interpolation_gives_other_tokens(case):
  """What the interpolated sizes guard against: the two rules differ where they resize."""
  config = make.model_config(case)
  variables = _import(reference_state_dict(make, case), case)
  config.position_interpolation = (
    "offset" if config.position_interpolation == "antialias" else "antialias"
  )
  size = make.SIZES[1]
  tokens, _ = _tokens(config, variables, make.images(case, size))
  assert _relative(tokens, _committed(case, size)) > 1e-3
  size = make.SIZES[0]  # No resizing at the checkpoint's grid: the same.
  tokens, _ = _tokens(config, variables, make.images(case, size))
  assert _relative(tokens, _committed(case, size)) < TOLERANCE


@pytest.mark.parametrize("grid,out", [(8, 5), (8, 11), (37, 16), (37, 37), (4, 1)])
def test_antialiased_resizing_matrix_is_a_normalised_pil_cubic_filter(grid, out):
  """Hand-worked properties of torch's antialiased bicubic: rows sum to 1, a constant stays
  constant, upsampling's filter (support 2) interpolates the inputs on its sample points."""
  w = vit.antialiased_bicubic_resize_matrix(grid, out)
  np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
  if out == grid:
    np.testing.assert_allclose(w, np.eye(grid), atol=1e-12)
  if out == 1:  # By hand: centre 2, stretch 4, |x| = 3/8, 1/8, 1/8, 3/8 for inputs 0..3.
    near = lambda x: (1.5 * x - 2.5) * x * x + 1
    ends, middle = near(3 / 8), near(1 / 8)
    np.testing.assert_allclose(
      w[0], np.array([ends, middle, middle, ends]) / (2 * ends + 2 * middle)
    )
  if grid == 37 and out == 16:  # Downsampling widens the support to 2 x 37 / 16 inputs a side.
    assert np.count_nonzero(w[8]) == 9


def test_export_writes_dinov2s_state_dict():
  """The export is DINOv2's layout: every tensor of the file bit for bit, mask_token zeros."""
  case = "dinov2_vit_small_reg4"
  tensors = reference_state_dict(make, case)
  variables = _import(tensors, case)
  exported = state_dicts.to_state_dict(make.model_config(case), variables, make.SIZES[0])
  assert sorted(exported) == sorted(tensors)
  for name, value in tensors.items():
    if name == "mask_token":
      np.testing.assert_array_equal(exported[name], np.zeros_like(value))
    else:
      np.testing.assert_array_equal(exported[name], value)


def _dinov3_like(tensors):
  """A DINOv3 ViT's distinctive tensors (dinov3 vision_transformer.py): RoPE periods and
  storage tokens, no learned position embedding."""
  out = {k: v for k, v in tensors.items() if k not in ("pos_embed", "register_tokens")}
  out["storage_tokens"] = np.zeros((1, 4, 384), np.float32)
  out["rope_embed.periods"] = np.ones((16,), np.float32)
  return out


def _swiglu_names(tensors):
  """DINOv2's ViT-g names of the MLP (SwiGLUFFNFused: mlp.w12, mlp.w3)."""
  return {
    k.replace(".mlp.fc1.", ".mlp.w12.").replace(".mlp.fc2.", ".mlp.w3."): v
    for k, v in tensors.items()
  }


@pytest.mark.parametrize(
  "source,change,fields,message",
  [
    ("dinov2_vit_small_reg4", None, {}, "has a tensor 'register_tokens' that a vit_small"),
    ("dinov2_vit_small_reg4", None, {}, "4 register tokens: --config.model.registers=4$"),
    ("dinov2_vit_small", None, dict(registers=4), "has no tensor 'register_tokens'"),
    ("dinov2_vit_small", None, dict(registers=4), "--config.model.registers=0$"),
    ("dinov2_vit_small", None, dict(layer_scale=False), "--config.model.layer_scale=True$"),
    (
      "dinov2_vit_small",
      None,
      dict(name="vit_base", num_heads=12),
      r"tensor 'cls_token' has shape \[1, 1, 384\] where a vit_base \(D 768, depth 12, patch "
      r"14, registers 0, layer_scale True, mlp 'gelu'\) on 112 px images needs \[1, 1, 768\]",
    ),
    ("dinov2_vit_small", None, dict(patch_size=16), r"patch_embed.proj.weight' has shape"),
    ("dinov2_vit_small", None, dict(depth=11), "has a tensor 'blocks.11.attn.proj.bias'"),
    (
      "dinov2_vit_small",
      None,
      dict(mlp="swiglu"),
      r"tensor 'blocks.0.mlp.w12.weight' has shape \[1536, 384\] where .* needs \[2048, 384\]",
    ),
    ("dinov2_vit_small", _swiglu_names, {}, "has SwiGLU .*: --config.model.mlp=swiglu$"),
    ("dinov2_vit_small", _dinov3_like, {}, "it holds a DINOv3 ViT .storage_tokens"),
    ("dinov2_vit_small_reg4", _dinov3_like, {}, "it holds a DINOv3 ViT .storage_tokens"),
  ],
)
def test_a_file_of_another_kind_is_refused_in_one_line(source, change, fields, message):
  tensors = reference_state_dict(make, source)
  tensors = change(tensors) if change else tensors
  config = make.model_config("dinov2_vit_small")
  config.update(fields)
  with pytest.raises(WeightsError, match=message) as error:
    state_dicts.from_state_dict(tensors, "w.pth", config, make.SIZES[0])
  assert str(error.value).startswith("w.pth: ") and "\n" not in str(error.value)


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("registers", -1, "an integer >= 0"),
    ("registers", True, "an integer >= 0"),
    ("position_grid", 2.5, "an integer >= 0"),
    ("position_interpolation", "bilinear", "one of \\['offset', 'antialias'\\]"),
    ("mlp", "relu", "one of \\['gelu', 'swiglu'\\]"),
    ("layer_scale", 1, "True or False"),
  ],
)
def test_a_bad_field_is_refused_naming_it(field, value, message):
  config = ml_collections.ConfigDict({**make.CASES["dinov2_vit_small"][0], field: value})
  with pytest.raises(ConfigError, match=f"^config.model.{field}={value!r}: must be {message}"):
    models.check_model_config(config)


def test_an_image_size_that_is_not_a_multiple_of_the_patch_is_refused():
  models.check_model_config(make.model_config("dinov2_vit_small"), 14 * 16)
  with pytest.raises(ConfigError, match=r"model.patch_size=14: .*divides image_size \(225\)"):
    models.check_model_config(make.model_config("dinov2_vit_small"), 225)


def _numpy_swiglu_block(p, x, heads):
  """DINOv2's block with SwiGLUFFNFused and layer scale, transcribed in numpy (float64):
  x + ls1 * attn(LN(x)), then x + ls2 * w3(silu(a) * b), [a, b] = w12(LN(x)) split in half."""

  def norm(y, name):
    mean, var = y.mean(-1, keepdims=True), y.var(-1, keepdims=True)
    return (y - mean) / np.sqrt(var + 1e-6) * p[name]["scale"] + p[name]["bias"]

  dense = lambda y, name: y @ p[name]["kernel"] + p[name]["bias"]
  n, t, d = x.shape
  q, k, v = np.moveaxis(dense(norm(x, "norm1"), ("attn", "qkv")).reshape(n, t, 3, heads, -1), 2, 0)
  logits = np.einsum("nqhd,nkhd->nhqk", q, k) / np.sqrt(d // heads)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  out = np.einsum("nhqk,nkhd->nqhd", weights, v).reshape(n, t, d)
  x = x + p["ls1"] * dense(out, ("attn", "proj"))
  a, b = np.split(dense(norm(x, "norm2"), "w12"), 2, axis=-1)
  return x + p["ls2"] * dense(a / (1 + np.exp(-a)) * b, "w3")


def test_swiglu_block_equals_dinov2s_formula():
  d, heads = 48, 4
  assert vit.swiglu_hidden(1536) == 4096  # ViT-g's (dinov2 hub: w12 [8192, 1536]).
  block = vit.Block(heads, layer_scale=True, mlp="swiglu")
  x = np.random.default_rng(0).normal(size=(2, 5, d)).astype(np.float32)
  params = block.init(jax.random.PRNGKey(0), x)["params"]
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda v: rng.normal(size=v.shape).astype(np.float32) * 0.3, params)
  p = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
  p = {**p, ("attn", "qkv"): p["attn"]["qkv"], ("attn", "proj"): p["attn"]["proj"]}
  got = np.asarray(block.apply({"params": params}, x))
  want = _numpy_swiglu_block(p, x.astype(np.float64), heads)
  assert _relative(got, want) < 1e-5
  assert params["w12"]["kernel"].shape == (d, 2 * vit.swiglu_hidden(d))


@pytest.mark.parametrize("name", sorted(recipes.DINOV2_MODELS))
def test_dinov2_recipes_have_the_published_shapes(name):
  """Widths, depths and heads of dinov2's vit_small / base / large / giant2, patch 14, 4
  registers in the _reg4 ones, a 37 x 37 position grid (518 px), SwiGLU in ViT-g only."""
  config = ml_collections.ConfigDict(recipes.dinov2_model(name, "float32"))
  models.check_model_config(config, 518)
  want = {"vit_small": (384, 6), "vit_base": (768, 12), "vit_large": (1024, 16)}
  want["vit_giant"] = (1536, 24)
  assert (models.encoder_width(config), vit.num_heads(config)) == want[config.name]
  assert config.depth == {"vit_giant": 40, "vit_large": 24}.get(config.name, 12)
  shapes = dict((e.name, s) for e, s in state_dicts.torch_shapes(config, 224))
  d = models.encoder_width(config)
  assert shapes["pos_embed"] == (1, 1 + 37 * 37, d)
  assert shapes.get("register_tokens") == ((1, 4, d) if "reg4" in name else None)
  assert shapes["patch_embed.proj.weight"] == (d, 3, 14, 14)
  if config.name == "vit_giant":
    assert shapes["blocks.0.mlp.w12.weight"] == (8192, 1536)
    assert shapes["blocks.0.mlp.w3.weight"] == (1536, 4096)


@pytest.mark.parametrize("case", list(make.CASES))
def test_onnx_graph_gives_the_references_class_token(case):
  import onnxruntime  # pylint: disable=import-outside-toplevel

  config = make.model_config(case)
  variables = _import(reference_state_dict(make, case), case)
  for size in make.SIZES[:2]:
    tensors = state_dicts.to_state_dict(config, variables, size)
    session = onnxruntime.InferenceSession(
      onnx_graph.build(config, tensors, size).SerializeToString(),
      providers=["CPUExecutionProvider"],
    )
    h = session.run([onnx_graph.H], {onnx_graph.INPUT: make.images(case, size)})[0]
    assert _relative(h, _committed(case, size)[:, 0]) < TOLERANCE


def test_downstream_jobs_read_a_dinov2_file_with_its_config(tmp_path):
  """restore.restore_encoder (probe, fine-tuning, label efficiency, embed) of a DINOv2 ViT-S/14
  reg4 file in timm's names with configs/dinov2.py: DINOv2's 37 x 37 position grid used at
  224 px; the model without registers refuses it in one line."""
  from helpers import load_config  # pylint: disable=import-outside-toplevel

  from contrastive_jax.core import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from contrastive_jax.core.errors import JobError  # pylint: disable=import-outside-toplevel
  from contrastive_jax.training import restore  # pylint: disable=import-outside-toplevel

  model = "model=vit_small_patch14_reg4_dinov2,dtype=float32"
  pretrained = load_config("dinov2", model)
  rng = np.random.default_rng(0)
  tensors = {
    entry.name: (rng.normal(size=shape) * 0.02).astype(np.float32)
    for entry, shape in state_dicts.torch_shapes(pretrained.model, 518)
  }
  path = str(tmp_path / "vit_small_patch14_reg4_dinov2.safetensors")
  tensor_files.write(path, _timm_names("", tensors))
  config = load_config("linear_probe")
  config.update(pretrain_workdir=path, pretrain_config=f"configs/dinov2.py:{model}")
  encoder = restore.restore_encoder(config, mesh_lib.make_mesh())
  assert (encoder.dim, encoder.step, encoder.pretrained.image_size) == (384, 0, 224)
  # timm's names fold the class token's position into cls_token: the same function.
  want = state_dicts.from_state_dict(tensors, "x", pretrained.model, 224)
  assert want["params"]["pos_embed"].shape == (1, 1 + 37 * 37, 384)
  images = rng.integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)
  h = models.encode(encoder.module, jax.device_get(encoder.variables), images)
  assert _relative(h, models.encode(models.build_encoder(pretrained.model), want, images)) < 1e-5
  config.pretrain_config = "configs/dinov2.py:model=vit_small_patch14_dinov2,dtype=float32"
  with pytest.raises(JobError, match=r"has a tensor 'register_tokens' .*registers=4$"):
    restore.restore_encoder(config, mesh_lib.make_mesh())


@pytest.fixture(scope="module")
def live_outputs(tmp_path_factory):
  """make_dinov2.py's outputs made now, with timm's own initialisations, in a process of its
  own (torch's triton crashes when imported after TensorFlow)."""
  folder = tmp_path_factory.mktemp("dinov2_outputs")
  root = os.path.dirname(os.path.dirname(FOLDER))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  subprocess.run(
    [sys.executable, make.__file__, str(folder), "--own-init"], check=True, env=env, timeout=600
  )
  return folder


@pytest.mark.skipif(not HAVE_TORCH, reason="needs the torch extra (torch, timm)")
@pytest.mark.parametrize("case", list(make.CASES))
def test_live_reference_agrees_with_committed_outputs_and_timms_own_init(case, live_outputs):
  live = np.load(live_outputs / f"{case}.npz")
  for size in make.SIZES:
    assert _relative(live[f"tokens_{size}"], _committed(case, size)) < TOLERANCE
  own = np.load(live_outputs / f"{case}.own.npz")
  # timm's conversion of the reference's dict computes the reference's function.
  assert _relative(own["timm_tokens"], _committed(case, make.SIZES[0])) < TOLERANCE
  config, images = make.model_config(case), make.images(case, make.SIZES[0])
  for name, key in (("own", "tokens"), ("timm", "timm_tokens")):
    path = str(live_outputs / f"{case}.{name}.safetensors")
    variables = state_dicts.from_state_dict(tensor_files.read(path), path, config, make.SIZES[0])
    tokens, _ = _tokens(config, variables, images)
    assert _relative(tokens, own[key]) < TOLERANCE


@pytest.mark.skipif(not HAVE_TORCH, reason="needs the torch extra (torch, timm)")
def test_a_pth_that_is_not_a_plain_state_dict_is_refused(tmp_path):
  """torch.load with weights_only refuses a pickle of arbitrary objects, in one line."""
  import torch  # pylint: disable=import-outside-toplevel

  path = tmp_path / "dinov2_vits14.pth"
  tensors = {k: torch.from_numpy(v) for k, v in make.random_state_dict("dinov2_vit_small").items()}
  torch.save({"model": tensors, "extra": ml_collections.ConfigDict({"a": 1})}, str(path))
  with pytest.raises(WeightsError, match="not a PyTorch checkpoint torch can read safely"):
    tensor_files.read(str(path))
  torch.save(tensors, str(path))
  variables = _import(tensor_files.read(str(path)), "dinov2_vit_small", str(path))
  tokens, _ = _tokens(
    make.model_config("dinov2_vit_small"), variables, make.images("dinov2_vit_small", 112)
  )
  assert _relative(tokens, _committed("dinov2_vit_small", 112)) < TOLERANCE


# A DINOv2-shaped ViT small enough for a DINO step in a test: D 24 (vit_small at width
# 1/16), one block, 4 registers, layer scale, patch 14 and a 2 x 2 position grid.
TINY_DINOV2 = """
from contrastive_jax import recipes

def get_config(arg=""):
  config = recipes.base_config()
  config.model = dict(
    recipes.dinov2_model("vit_small_patch14_reg4_dinov2", "float32"),
    width=1 / 16, depth=1, position_grid=2,
  )
  return config
"""


def test_dino_continues_a_dinov2_file_student_and_teacher_from_it_heads_new(tmp_path):
  """init_from a DINOv2-shaped file with init_config naming its model: the run's model is the
  file's, student and teacher encoders at step 0 are exactly the file's weights, the DINO
  heads are the method's fresh initialisation, and one step trains the student."""
  from helpers import tiny_config  # pylint: disable=import-outside-toplevel

  from contrastive_jax.core import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from contrastive_jax.jobs import pretrain  # pylint: disable=import-outside-toplevel
  from contrastive_jax.methods import pretraining  # pylint: disable=import-outside-toplevel

  config_file = tmp_path / "tiny_dinov2.py"
  config_file.write_text(TINY_DINOV2)
  config = tiny_config("dino", "runlocal")
  config.image_size = 28  # The 2 x 2 grid of patch 14.
  bare = config.copy_and_resolve_references()
  bare.init_config = str(config_file)
  with pytest.raises(ConfigError, match=r"init_config.*unset without init_from"):
    pretrain.check_config(bare, jax.device_count())
  model = ml_collections.ConfigDict(
    dict(recipes.dinov2_model("vit_small_patch14_reg4_dinov2", "float32"))
  )
  model.update(width=1 / 16, depth=1, position_grid=2)
  rng = np.random.default_rng(0)
  tensors = {
    entry.name: (rng.normal(size=shape) * 0.3).astype(np.float32)
    for entry, shape in state_dicts.torch_shapes(model, 28)
  }
  assert tensors["register_tokens"].shape == (1, 4, 24) and "blocks.0.ls1.gamma" in tensors
  path = str(tmp_path / "dinov2_tiny.safetensors")
  tensor_files.write(path, tensors)
  config.update(init_from=path, init_config=str(config_file))
  pretrain.check_config(config, jax.device_count())
  resolved = pretrain.with_init_model(config)
  assert resolved.model.to_dict() == model.to_dict() and config.model.name == "vit_tiny"
  mesh = mesh_lib.make_mesh()
  run = pretraining.setup(resolved, mesh, 10, 20, 10, pretrain.imported_start(resolved))
  start = run.init()
  state = jax.device_get(start)
  fresh = jax.device_get(pretraining.setup(resolved, mesh, 10, 20, 10).init())
  want = state_dicts.from_state_dict(tensors, path, model, 28)["params"]
  for params in (state.params, state.extra["teacher_params"]):
    jax.tree.map(np.testing.assert_array_equal, params["encoder"], want)
  # The heads are the method's initialisation, as a run without the file draws them.
  jax.tree.map(np.testing.assert_array_equal, state.params["projector"], fresh.params["projector"])
  jax.tree.map(
    np.testing.assert_array_equal,
    state.extra["teacher_params"]["projector"],
    fresh.extra["teacher_params"]["projector"],
  )
  batch = {
    "image": rng.integers(0, 256, (16, 2, 28, 28, 3), dtype=np.uint8),
    "label": np.zeros(16, np.int32),
  }
  batch = jax.device_put(batch, mesh_lib.batch_sharded(mesh))
  after = start
  for _ in range(2):  # Step 0's learning rate is the warm-up's 0.
    after, metrics = run.train_step(after, batch)
    assert np.isfinite(float(metrics["loss"]))
  moved = jax.device_get(after.params["encoder"])
  assert not np.array_equal(moved["cls_token"], want["cls_token"])
