"""Weights in and out: the encoders equal the references' networks; state dicts
and safetensors files round-trip; bad files are refused in one line.

The reference outputs are tests/reference_outputs/*.npz, made by
tests/reference_outputs/make.py with the stock torchvision / timm models; with
torch installed the tests here also run those models live.
"""

import importlib.util
import os
import subprocess
import sys

from helpers import load_config
from helpers import reference_state_dict
from helpers import tiny_config
import jax
import ml_collections
import numpy as np
import pytest
from reference_outputs import make

from contrastive_jax import models
from contrastive_jax import recipes
from contrastive_jax.core import tensor_files
from contrastive_jax.core.errors import WeightsError
from contrastive_jax.methods import get_method
from contrastive_jax.models import onnx_graph
from contrastive_jax.models import state_dicts

HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "torchvision", "timm"))
TOLERANCE = 1e-4  # Relative: max |h - h_ref| / max |h_ref|, float32.


def _relative(h, ref):
  return float(np.max(np.abs(np.asarray(h) - ref)) / np.max(np.abs(ref)))


def _h(case, variables, config=None):
  config = config or make.model_config(case)
  return np.asarray(models.encode(models.build_encoder(config), variables, make.images(case)))


def _committed(case):
  return np.load(f"{make.__file__.rsplit('/', 1)[0]}/{case}.npz")["h"]


@pytest.mark.parametrize("case", list(make.CASES))
def test_h_equals_the_reference_implementations(case):
  config, size = make.model_config(case), make.CASES[case][1]
  variables = state_dicts.from_state_dict(reference_state_dict(make, case), "x", config, size)
  assert _relative(_h(case, variables), _committed(case)) < TOLERANCE


def test_the_legacy_padding_differs_from_torchvision():
  """What the equality test guards against: 'SAME' pads an even input after only."""
  case = "torchvision_resnet18"
  config = make.model_config(case)
  config.padding = "legacy"
  variables = state_dicts.from_state_dict(reference_state_dict(make, case), "x", config, 64)
  assert _relative(_h(case, variables, config), _committed(case)) > 0.01


@pytest.fixture(scope="module")
def live_outputs(tmp_path_factory):
  """make.py's outputs made now, with its stock models' own initialisations too, in a
  process of its own (torch's triton crashes when imported after TensorFlow)."""
  folder = tmp_path_factory.mktemp("reference_outputs")
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(
      [
        os.path.dirname(os.path.dirname(os.path.abspath(make.__file__))) + "/..",
        os.environ.get("PYTHONPATH", ""),
      ]
    ),
  )
  subprocess.run(
    [sys.executable, make.__file__, str(folder), "--own-init"], check=True, env=env, timeout=600
  )
  return folder


def _backbone(case, tensors):
  """The backbone of a DINO case's teacher (tensors: its state dict), prefix removed."""
  prefix = make.DINO_TEACHER_PREFIX[case]
  return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


@pytest.mark.skipif(not HAVE_TORCH, reason="needs the torch extra (torch, torchvision, timm)")
@pytest.mark.parametrize("case", list(make.CASES))
def test_live_reference_agrees_with_committed_outputs_and_its_own_init(case, live_outputs):
  # torch releases round float32 differently (1.4e-6 between 2.13 and 2.14 on the ViTs).
  assert _relative(np.load(live_outputs / f"{case}.npz")["h"], _committed(case)) < 1e-5
  # The stock model's own random initialisation (BN statistics 0 and 1 there); a DINO case's
  # in a main_dino.py checkpoint (.pth with its argparse arguments), read as its teacher.
  config, size = make.model_config(case), make.CASES[case][1]
  dino = case in make.DINO_TEACHER_PREFIX
  path = str(live_outputs / f"{case}.own.{'pth' if dino else 'safetensors'}")
  tensors = tensor_files.read(path)
  variables = state_dicts.from_state_dict(tensors, path, config, size)
  own = np.load(live_outputs / f"{case}.own.npz")
  assert _relative(_h(case, variables), own["h"]) < TOLERANCE
  if case in make.OTHER_SIZES:
    images = make.images(case, make.OTHER_SIZES[case])
    h = models.encode(models.build_encoder(config), variables, images)
    assert _relative(h, own["h_other"]) < TOLERANCE
  # The export has exactly the stock model's tensors (make.py loads them strictly).
  exported = state_dicts.to_state_dict(config, variables, size)
  tensors = _backbone(case, tensors) if dino else tensors
  assert sorted(exported) == sorted(tensors)
  for name, value in exported.items():  # A fixed pos_embed: float64 here, float32 there.
    np.testing.assert_allclose(
      value, tensors[name].astype(value.dtype), rtol=0, atol=1e-7 if name == "pos_embed" else 0
    )


@pytest.mark.parametrize("case", sorted(make.DINO_TEACHER_PREFIX))
def test_a_dino_checkpoint_gives_its_teachers_h_and_exports_its_backbone(case):
  config, size = make.model_config(case), make.CASES[case][1]
  backbone = reference_state_dict(make, case)
  checkpoint = make.dino_checkpoint(case, backbone)
  tensors = tensor_files.state_dict(
    {k: v for k, v in checkpoint.items() if isinstance(v, dict)}, "x"
  )
  assert tensors is checkpoint["teacher"]
  variables = state_dicts.from_state_dict(tensors, "x", config, size)
  assert _relative(_h(case, variables), _committed(case)) < TOLERANCE
  if case in make.OTHER_SIZES:  # A local view's size: the interpolated position embedding.
    images = make.images(case, make.OTHER_SIZES[case])
    h = models.encode(models.build_encoder(config), variables, images)
    other = np.load(f"{make.__file__.rsplit('/', 1)[0]}/{case}.npz")["h_other"]
    assert _relative(h, other) < TOLERANCE
  # The student (module.backbone.) is another network: importing it gives another h.
  other = state_dicts.from_state_dict(checkpoint["student"], "x", config, size)
  assert _relative(_h(case, other), _committed(case)) > 0.01
  # Exported: DINO's backbone state dict (its published *_pretrain.pth layout), bit for bit.
  exported = state_dicts.to_state_dict(config, variables, size)
  assert sorted(exported) == sorted(backbone)
  for name, value in backbone.items():
    np.testing.assert_array_equal(exported[name], value)
  # Another architecture's DINO checkpoint: one line naming what the file holds.
  other_case = "dino_resnet50" if case == "dino_vit_small" else "dino_vit_small"
  held = make.dino_checkpoint(other_case, reference_state_dict(make, other_case))["teacher"]
  with pytest.raises(WeightsError, match=r"^f.pth: not the weights of a .*; it holds a "):
    state_dicts.from_state_dict(held, "f.pth", config, size)


@pytest.mark.parametrize("case", ["torchvision_resnet18", "mocov3_vit_small", "timm_vit_small"])
def test_import_export_import_round_trips_bit_for_bit(case, tmp_path):
  config, size = make.model_config(case), make.CASES[case][1]
  tensors = reference_state_dict(make, case)
  variables = state_dicts.from_state_dict(tensors, "x", config, size)
  path = str(tmp_path / "encoder.safetensors")
  tensor_files.write(path, state_dicts.to_state_dict(config, variables, size), {"a": "b"})
  read = tensor_files.read(path)
  for name, value in tensors.items():
    np.testing.assert_array_equal(read[name], value)
  again = state_dicts.from_state_dict(read, path, config, size)
  jax.tree.map(np.testing.assert_array_equal, again, variables)


def test_safetensors_keeps_dtypes_and_shapes(tmp_path):
  path = str(tmp_path / "t.safetensors")
  tensors = {
    "a": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b": np.int64(7) * np.ones(()),
    "c": np.arange(3, dtype=np.float16),
    "d": np.zeros((0, 2), np.float32),
  }
  tensors["b"] = tensors["b"].astype(np.int64)
  tensor_files.write(path, tensors)
  read = tensor_files.read(path)
  assert sorted(read) == sorted(tensors)
  for name, value in tensors.items():
    assert read[name].dtype == value.dtype and read[name].shape == value.shape
    np.testing.assert_array_equal(read[name], value)


def test_checkpoint_prefixes_and_heads_are_stripped():
  """A MoCo v3 checkpoint: base_encoder (kept), momentum_encoder, predictor and the
  projector in base_encoder.head (left out)."""
  case = "mocov3_vit_small"
  config, size = make.model_config(case), make.CASES[case][1]
  tensors = reference_state_dict(make, case)
  tensors["pos_embed"] = state_dicts.fixed_position_embedding(config, size)
  checkpoint = {f"module.base_encoder.{k}": v for k, v in tensors.items()}
  checkpoint.update({f"module.momentum_encoder.{k}": v + 1 for k, v in tensors.items()})
  checkpoint["module.base_encoder.head.0.weight"] = np.zeros((4, 384), np.float32)
  checkpoint["module.predictor.0.weight"] = np.zeros((4, 256), np.float32)
  variables = state_dicts.from_state_dict(checkpoint, "x", config, size)
  plain = state_dicts.from_state_dict(tensors, "x", config, size)
  jax.tree.map(np.testing.assert_array_equal, variables, plain)


# The fields of a ResNet config that _resnet's callers leave out.
_LEGACY_FIELDS = dict(
  zero_init_residual=True,
  conv_init="he_normal",
  stage_projection=False,
  input_mean=(0.0, 0.0, 0.0),
  input_std=(1.0, 1.0, 1.0),
)


def _resnet(name="resnet18", **fields):
  return ml_collections.ConfigDict(
    dict(
      name=name,
      width=1.0,
      stem="imagenet",
      dtype="float32",
      **{**_LEGACY_FIELDS, "padding": "torchvision", **fields},
    )
  )


@pytest.mark.parametrize(
  "change,message",
  [
    (lambda t: t, None),
    (
      lambda t: {k: v for k, v in t.items() if k != "layer4.1.bn2.running_var"},
      "has no tensor 'layer4.1.bn2.running_var'",
    ),
    (
      lambda t: dict(t, **{"layer4.2.conv1.weight": np.zeros((512, 512, 3, 3), np.float32)}),
      "has a tensor 'layer4.2.conv1.weight' that a resnet18",
    ),
    (
      lambda t: dict(t, **{"conv1.weight": np.zeros((64, 3, 3, 3), np.float32)}),
      "tensor 'conv1.weight' has shape [64, 3, 3, 3] where a resnet18 (width 1.0, stem "
      "'imagenet') on 64 px images needs [64, 3, 7, 7]",
    ),
    (lambda t: {"patch_embed.proj.weight": np.zeros(1)}, "it holds a ViT (patch_embed.proj"),
    (lambda t: {"foo": np.zeros(1)}, "its first tensor is 'foo'"),
  ],
)
def test_a_file_that_does_not_fit_is_refused_naming_the_first_misfit(change, message):
  tensors = change(reference_state_dict(make, "torchvision_resnet18"))
  if message is None:
    state_dicts.from_state_dict(tensors, "f.safetensors", _resnet(), 64)
    return
  with pytest.raises(WeightsError, match=None) as error:
    state_dicts.from_state_dict(tensors, "f.safetensors", _resnet(), 64)
  assert message in str(error.value) and "\n" not in str(error.value)
  assert str(error.value).startswith("f.safetensors: ")


def test_a_resnet50_file_is_not_a_resnet18():
  with pytest.raises(WeightsError, match="has a tensor 'layer1.0.bn3.bias' that a resnet18"):
    state_dicts.from_state_dict(
      reference_state_dict(make, "torchvision_resnet50"), "f", _resnet(), 64
    )


def test_a_learned_position_embedding_is_not_taken_for_the_fixed_one():
  tensors = reference_state_dict(make, "timm_vit_small")
  config = make.model_config("timm_vit_small")
  config.position_embedding = "sincos"
  with pytest.raises(WeightsError, match="position_embedding=learned"):
    state_dicts.from_state_dict(tensors, "f", config, 32)


@pytest.mark.parametrize(
  "name,content,message",
  [
    ("w.npz", b"", "the name must end in .safetensors or one of .pth"),
    ("w.safetensors", b"PK\x03\x04 not safetensors at all", "not a safetensors file"),
    ("w.safetensors", b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "not a JSON object"),
    (
      "w.safetensors",
      b"\x30\x00\x00\x00\x00\x00\x00\x00"
      + b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'[:48],
      "not JSON",
    ),
  ],
)
def test_a_file_that_is_not_a_weights_file_is_refused(tmp_path, name, content, message):
  path = tmp_path / name
  path.write_bytes(content)
  with pytest.raises(WeightsError, match=message):
    tensor_files.read(str(path))


def test_reading_a_missing_file_says_so(tmp_path):
  with pytest.raises(WeightsError, match="no such file"):
    tensor_files.read(str(tmp_path / "w.safetensors"))


@pytest.mark.skipif(HAVE_TORCH, reason="checks the message without torch")
def test_a_pth_without_torch_says_which_extra(tmp_path):
  path = tmp_path / "w.pth"
  path.write_bytes(b"x")
  with pytest.raises(WeightsError, match=r"contrastive_jax\[torch\]"):
    tensor_files.read(str(path))


@pytest.mark.parametrize(
  "name,variant,padding",
  [
    ("simclr_cifar10", "", "tensorflow"),
    ("simclr_imagenet", "", "tensorflow"),
    ("moco_v2_cifar10", "runlocal", "torchvision"),
    ("moco_v1_imagenet", "", "torchvision"),
    ("mocov3_imagenet", "resnet50", "torchvision"),
    ("byol_imagenet", "", "same"),
    ("byol_cifar10", "", "torchvision"),
  ],
)
def test_each_config_pins_its_references_padding(name, variant, padding):
  assert load_config(name, variant).model.padding == padding


@pytest.mark.parametrize("variant,final_bn", [("", True), ("vit_small", True), ("resnet50", False)])
def test_mocov3_predictor_ends_as_the_references(variant, final_bn):
  """builder.py: MoCo_ViT's predictor ends in a BN without affine parameters; MoCo_ResNet's not."""
  config = load_config("mocov3_imagenet", variant)
  assert config.predictor.final_bn == final_bn and not config.predictor.final_bn_scale
  mlp = models.build_mlp(config.predictor, "float32")
  variables = jax.eval_shape(lambda: mlp.init(jax.random.PRNGKey(0), np.zeros((2, 8)), train=False))
  last_bn = sorted(k for k in variables["params"] if k.startswith("BatchNorm"))[-1:]
  has_final = "BatchNorm_1" in variables["batch_stats"]
  assert has_final == final_bn
  if final_bn:
    assert last_bn == ["BatchNorm_0"]  # The final BN has no parameters, only statistics.


def test_a_field_a_checkpoint_lacks_and_left_unset_is_no_resume_difference():
  """A checkpoint whose config has no init_from / pretrain_config field resumes with them
  unset."""
  from contrastive_jax.core import checkpointing  # pylint: disable=import-outside-toplevel

  config = ml_collections.ConfigDict(dict(a=1, pretrain_config=None, b=dict(c=None)))
  assert checkpointing.config_differences({"a": 1}, config, ()) == []
  config.pretrain_config = "configs/x.py"
  assert checkpointing.config_differences({"a": 1}, config, ()) == [
    ("pretrain_config", "<absent>", "configs/x.py")
  ]


@pytest.mark.skipif(not HAVE_TORCH, reason="needs the torch extra")
def test_a_moco_pth_tar_checkpoint_is_read_with_its_prefix_and_heads_left_out(tmp_path):
  """main_moco.py's checkpoint: {'epoch', 'arch', 'state_dict', 'optimizer'}, the query
  encoder under module.encoder_q. with its MLP head in fc.*, the key encoder and queue."""
  import torch  # pylint: disable=import-outside-toplevel

  tensors = make.random_state_dict("torchvision_resnet18")
  state = {f"module.encoder_q.{k}": torch.tensor(v) for k, v in tensors.items()}
  state.update({f"module.encoder_k.{k}": torch.tensor(v + 1) for k, v in tensors.items()})
  state["module.encoder_q.fc.0.weight"] = torch.zeros(512, 512)
  state["module.queue"] = torch.zeros(128, 16)
  path = str(tmp_path / "checkpoint_0199.pth.tar")
  torch.save(
    {
      "epoch": 200,
      "arch": "resnet18",
      "state_dict": state,
      "optimizer": {"state": {}, "param_groups": [{"lr": 0.03}]},
    },
    path,
  )
  variables = state_dicts.from_state_dict(tensor_files.read(path), path, _resnet(), 64)
  plain = state_dicts.from_state_dict(tensors, "x", _resnet(), 64)
  jax.tree.map(np.testing.assert_array_equal, variables, plain)
  (tmp_path / "junk.pth").write_bytes(b"not a pickle")
  with pytest.raises(WeightsError, match="not a PyTorch checkpoint torch can read safely"):
    tensor_files.read(str(tmp_path / "junk.pth"))


def _onnx_h(config, tensors, size, images):
  import onnxruntime

  model = onnx_graph.build(config, tensors, size)
  session = onnxruntime.InferenceSession(
    model.SerializeToString(), providers=["CPUExecutionProvider"]
  )
  return session.run([onnx_graph.H], {onnx_graph.INPUT: images})[0]


def _drawn_variables(shapes, rng):
  """float32 numpy variables of the ShapeDtypeStructs `shapes`, drawn on the host as the
  networks initialise them (kernels normal with He's variance by fan-in, BN and LayerNorm
  scales and BN variances 1, the rest 0), each plus U(0.1, 0.5): non-trivial BN statistics
  and shifts, so that a misplaced one shows. (Flax's eager initialisation of a whole
  network compiles each of its operations: about 2 s of CPU a network.)"""

  def draw(path, leaf):
    name = path[-1].key
    if name == "kernel":
      base = rng.normal(0, np.sqrt(2 / np.prod(leaf.shape[:-1])), leaf.shape)
    else:
      base = np.full(leaf.shape, 1.0 if name in ("scale", "var") else 0.0)
    return (base + rng.uniform(0.1, 0.5, leaf.shape)).astype(np.float32)

  return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.mark.parametrize("case", list(make.CASES))
def test_onnx_graph_gives_the_reference_implementations_h(case):
  config, size = make.model_config(case), make.CASES[case][1]
  variables = state_dicts.from_state_dict(reference_state_dict(make, case), "x", config, size)
  tensors = state_dicts.to_state_dict(config, variables, size)
  assert _relative(_onnx_h(config, tensors, size, make.images(case)), _committed(case)) < TOLERANCE


@pytest.mark.parametrize("stem", ["imagenet", "cifar"])
@pytest.mark.parametrize("padding", ["tensorflow", "same", "legacy"])
@pytest.mark.parametrize("size", [32, 45])
def test_onnx_graph_pads_as_each_rule_on_even_and_odd_images(stem, padding, size):
  config = make.model_config("torchvision_resnet18")
  # The references padded so (SimCLR's, BYOL's) project every stage's first shortcut.
  config.update(
    stem=stem, padding=padding, width=0.125, stage_projection=padding in ("tensorflow", "same")
  )
  encoder = models.build_encoder(config)
  rng = np.random.default_rng(size)
  variables = _drawn_variables(state_dicts.variable_shapes(config, size), rng)
  images = rng.integers(0, 256, (3, size, size, 3), dtype=np.uint8)
  want = np.asarray(models.encode(encoder, variables, images))
  tensors = state_dicts.to_state_dict(config, variables, size)
  assert _relative(_onnx_h(config, tensors, size, images), want) < TOLERANCE


def test_simclr_and_byol_resnets_project_every_stages_first_shortcut():
  """SimCLR's TF ResNet and BYOL's Haiku ResNet-18 have a 1x1 projection (and its BN) in
  layer1.0 too: torchvision's ResNet-18 encoder has 11,176,512 parameters, theirs 64 * 64
  + 2 * 64 = 4,224 more."""
  count = lambda config: sum(
    v.size
    for v in jax.tree.leaves(
      state_dicts.variable_shapes(ml_collections.ConfigDict(config), 64)["params"]
    )
  )
  for reference, want in (
    ("torchvision", 11_176_512),
    ("simclr", 11_180_736),
    ("byol", 11_180_736),
  ):
    config = recipes.model("resnet18", "imagenet", "float32", reference)
    assert count(config) == want, reference
    assert (
      "layer1.0.downsample.0.weight"
      in {e.name for e in state_dicts.entries(ml_collections.ConfigDict(config), 64)}
    ) == (reference != "torchvision")
  # A bottleneck stage's first block changes the width: ResNet-50 is the same network.
  r50 = [recipes.model("resnet50", "imagenet", "float32", r) for r in ("torchvision", "simclr")]
  assert count(r50[0]) == count(r50[1]) == 23_508_032


@pytest.mark.parametrize(
  "method,variant",
  [
    ("simclr", "runlocal"),
    ("moco_v2", "runlocal"),
    ("byol", "runlocal"),
    ("mocov3", "runlocal"),
    ("mocov3", "runlocal_vit"),
  ],
)
def test_onnx_graph_gives_each_methods_projection(method, variant):
  """z of every projection head shape: SimCLR's last BN with a scale only, MoCo v2's without
  BN, BYOL's, MoCo v3's last BN without scale or bias (no params at all)."""
  config = tiny_config(method, variant)
  model = get_method(config.method).build_model(config)
  size, rng = 32, np.random.default_rng(7)
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.PRNGKey(0), np.zeros((1, size, size, 3), np.float32), train=False)
  )
  variables = _drawn_variables(shapes, rng)
  part = lambda name: {c: variables[c][name] for c in variables if name in variables[c]}
  images = rng.integers(0, 256, (3, size, size, 3), dtype=np.uint8)
  h = np.asarray(models.encode(model.encoder, part("encoder"), images))
  z = np.asarray(model.projector.apply(part("projector"), h, train=False))
  tensors = state_dicts.to_state_dict(config.model, part("encoder"), size)
  import onnxruntime

  onnx_model = onnx_graph.build(config.model, tensors, size, (model.projector, part("projector")))
  session = onnxruntime.InferenceSession(
    onnx_model.SerializeToString(), providers=["CPUExecutionProvider"]
  )
  got_h, got_z = session.run([onnx_graph.H, onnx_graph.Z], {onnx_graph.INPUT: images})
  assert _relative(got_h, h) < TOLERANCE and _relative(got_z, z) < TOLERANCE


@pytest.mark.parametrize("source,target", [("torchvision", "simclr"), ("byol", "torchvision")])
def test_a_file_with_or_without_the_first_stage_projection_names_the_field(source, target):
  config = ml_collections.ConfigDict(recipes.model("resnet18", "imagenet", "float32", source))
  zeros = jax.tree.map(
    lambda s: np.zeros(s.shape, np.float32), state_dicts.variable_shapes(config, 32)
  )
  tensors = state_dicts.to_state_dict(config, zeros, 32)
  fix = "False" if source == "torchvision" else "True"
  with pytest.raises(WeightsError, match=f"layer1.0.downsample.*stage_projection={fix}$"):
    state_dicts.from_state_dict(
      tensors,
      "w.safetensors",
      ml_collections.ConfigDict(recipes.model("resnet18", "imagenet", "float32", target)),
      32,
    )
