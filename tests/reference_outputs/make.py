"""Makes the reference implementations' outputs that tests/test_weights.py compares with.

  /path/to/venv-with-torch/bin/python tests/reference_outputs/make.py [OUT_DIR [--own-init]]

(with this repository on PYTHONPATH; needs `pip install -e '.[torch]'`: torch,
torchvision, timm). For each CASE, the weights are drawn with numpy from the
case's seed (random_state_dict: no torch needed, so the test draws the same
ones), loaded with load_state_dict(strict=True) into the stock reference model
(torchvision's resnet18 / resnet50 with fc = Identity; timm's
vit_small_patch16_224 at 32 px with num_classes=0; MoCo v3's ViT-S, i.e.
timm's VisionTransformer with 12 heads and the fixed sin-cos pos_embed, which
is computed here with torch from vits.py's formula, independently of
vit.py; DINO's vit_small at 224 px, whose forward with its position-embedding
interpolation is written out in _dino_vit_h, and its resnet50, torchvision's),
and run in eval mode on the case's images (images()); h goes to CASE.npz, a few
KB (DINO's ViT also h_other, at a local view's 96 px). dino_checkpoint puts a
case's weights in a main_dino.py checkpoint as its teacher. Committing the
outputs rather than the weights (ResNet-50's are 100 MB) keeps the repository
small and the test free of torch.
"""

import argparse
import importlib
import math
import os
import sys

import flax
import ml_collections
import numpy as np

from contrastive_jax.models import state_dicts

# name -> (model config fields, image size, seed). ImageNet standardisation as MoCo's.
_IMAGENET = dict(input_mean=(0.485, 0.456, 0.406), input_std=(0.229, 0.224, 0.225))
# A torchvision ResNet's fields but its padding (each case's); the initialisation is not used.
_TORCHVISION = dict(
  zero_init_residual=True, conv_init="he_normal", stage_projection=False, **_IMAGENET
)
# torchvision's resnet50 (DINO's too), and timm's vit_small_patch16_224 (DINO's vit_small:
# 6 heads, learned pos_embed).
_RESNET50 = dict(
  name="resnet50",
  width=1.0,
  stem="imagenet",
  dtype="float32",
  padding="torchvision",
  **_TORCHVISION,
)
_VIT_SMALL_LEARNED = dict(
  name="vit_small",
  width=1.0,
  depth=12,
  patch_size=16,
  num_heads=6,
  dtype="float32",
  random_patch_projection=False,
  position_embedding="learned",
  **_IMAGENET,
)
CASES = {
  "torchvision_resnet18": (
    dict(
      name="resnet18",
      width=1.0,
      stem="imagenet",
      dtype="float32",
      padding="torchvision",
      **_TORCHVISION,
    ),
    64,
    18,
  ),
  "torchvision_resnet50": (
    _RESNET50,
    64,
    50,
  ),
  "timm_vit_small": (
    _VIT_SMALL_LEARNED,
    32,
    6,
  ),
  # DINO's vit_small (vision_transformer.py: patch 16, D 384, depth 12, 6 heads, MLP 4x,
  # qkv bias, LayerNorm eps 1e-6, learned pos_embed, the class token's h) at its 224 px.
  "dino_vit_small": (
    _VIT_SMALL_LEARNED,
    224,
    16,
  ),
  # DINO's resnet50: torchvision's, fc = Identity (main_dino.py).
  "dino_resnet50": (
    _RESNET50,
    64,
    22,
  ),
  "mocov3_vit_small": (
    dict(
      name="vit_small",
      width=1.0,
      depth=12,
      patch_size=16,
      dtype="float32",
      random_patch_projection=True,
      position_embedding="sincos",
      **_IMAGENET,
    ),
    32,
    3,
  ),
}


# DINO's cases also give h at another size: a local view's 96 px, where DINO's ViT
# interpolates its position embedding (interpolate_pos_encoding).
OTHER_SIZES = {"dino_vit_small": 96}
# DINO's teacher is wrapped in DistributedDataParallel only when it has BN (main_dino.py).
DINO_TEACHER_PREFIX = {"dino_vit_small": "backbone.", "dino_resnet50": "module.backbone."}


def model_config(case: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(CASES[case][0])


def images(case: str, size: int = 0) -> np.ndarray:
  """Two uint8 [2, S, S, 3] images of the case (S its size unless given), from its seed."""
  size, seed = size or CASES[case][1], CASES[case][2]
  return np.random.default_rng(seed + 1000).integers(0, 256, (2, size, size, 3), dtype=np.uint8)


def random_state_dict(case: str) -> dict:
  """The case's weights in the reference's names, float32 numpy, drawn from its seed.

  Convolutions and Linears He-normal by fan-in, BN scales U(0.5, 1.5), shifts
  and running means U(-0.2, 0.2), running variances U(0.5, 2) (non-trivial
  statistics, so that a misplaced one shows), LayerNorms near identity, the
  class token and a learned pos_embed normal(0, 0.02), BN counters 0; a fixed
  pos_embed is vit.py's (reference_h puts the reference's in its place).
  """
  config, size, seed = CASES[case]
  config = ml_collections.ConfigDict(config)
  rng = np.random.default_rng(seed)
  shapes = {
    c: flax.traverse_util.flatten_dict(s)
    for c, s in state_dicts.variable_shapes(config, size).items()
  }
  out = {}
  for entry in state_dicts.entries(config, size):
    if entry.layout == "counter":
      out[entry.name] = np.zeros((), np.int64)
      continue
    if entry.layout == "fixed":  # The reference's own replaces it (reference_h).
      out[entry.name] = state_dicts.fixed_position_embedding(config, size)
      continue
    shape = state_dicts._torch_shape(shapes[entry.collection][entry.path].shape, entry.layout)  # pylint: disable=protected-access
    leaf = entry.path[-1]
    if entry.layout in ("conv", "dense"):
      value = rng.normal(size=shape) * np.sqrt(2.0 / np.prod(shape[1:]))
    elif leaf == "scale":
      value = rng.uniform(0.5, 1.5, shape)
    elif leaf in ("bias", "mean"):
      value = rng.uniform(-0.2, 0.2, shape)
    elif leaf == "var":
      value = rng.uniform(0.5, 2.0, shape)
    else:  # cls_token, pos_embed
      value = rng.normal(size=shape) * 0.02
    out[entry.name] = value.astype(np.float32)
  return out


def dino_checkpoint(case: str, backbone: dict) -> dict:
  """A main_dino.py checkpoint around `backbone` (the teacher's backbone state dict), in
  numpy: 'teacher' with the backbone under DINO_TEACHER_PREFIX and a DINO head (3 layers,
  hidden 64, bottleneck 16, 128 outputs, weight-normalised last layer), 'student' with
  another backbone (the teacher's times 1.05) and head under 'module.', 'dino_loss' with the
  centre, and the epoch."""
  rng = np.random.default_rng(CASES[case][2] + 2000)
  dim = next(v.shape[0] for k, v in backbone.items() if k in ("norm.weight", "layer4.2.bn3.weight"))
  head = {}
  for i, (fan_in, fan_out) in enumerate([(dim, 64), (64, 64), (64, 16)]):
    head[f"head.mlp.{2 * i}.weight"] = rng.normal(0, 0.02, (fan_out, fan_in)).astype(np.float32)
    head[f"head.mlp.{2 * i}.bias"] = np.zeros(fan_out, np.float32)
  head["head.last_layer.weight_g"] = np.ones((128, 1), np.float32)
  head["head.last_layer.weight_v"] = rng.normal(0, 0.02, (128, 16)).astype(np.float32)
  prefix = DINO_TEACHER_PREFIX[case]
  wrapper = prefix[: -len("backbone.")]
  teacher = {prefix + k: v for k, v in backbone.items()}
  teacher.update({wrapper + k: v for k, v in head.items()})
  student = {
    "module.backbone." + k: v * np.float32(1.05) if v.dtype == np.float32 else v
    for k, v in backbone.items()
  }
  student.update({"module." + k: v for k, v in head.items()})
  return {
    "student": student,
    "teacher": teacher,
    "dino_loss": {"center": rng.normal(size=(1, 128)).astype(np.float32)},
    "epoch": 100,
  }


def _standardised(case: str, size: int = 0) -> np.ndarray:
  """The case's images as the reference's input: NCHW float32, ImageNet-standardised."""
  x = images(case, size).astype(np.float32) / 255.0
  x = (x - np.float32(_IMAGENET["input_mean"])) / np.float32(_IMAGENET["input_std"])
  return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def _mocov3_pos_embed(torch, grid: int, dim: int):
  """vits.py's build_2d_sincos_position_embedding (temperature 1e4), class token row 0."""
  grid_w, grid_h = torch.meshgrid(
    torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32), indexing="ij"
  )
  quarter = dim // 4
  omega = 1.0 / 10000.0 ** (torch.arange(quarter, dtype=torch.float32) / quarter)
  out_w = grid_w.flatten()[:, None] * omega[None]
  out_h = grid_h.flatten()[:, None] * omega[None]
  table = torch.cat([torch.sin(out_w), torch.cos(out_w), torch.sin(out_h), torch.cos(out_h)], 1)
  return torch.cat([torch.zeros(1, dim), table])[None]


def reference_model(case: str, torch):
  """The stock reference network of a case, classifier removed, in eval mode."""
  import timm  # pylint: disable=import-outside-toplevel
  import torchvision  # pylint: disable=import-outside-toplevel

  config, size, _ = CASES[case]
  if config["name"].startswith("resnet"):
    model = getattr(torchvision.models, config["name"])()
    model.fc = torch.nn.Identity()
  elif case == "timm_vit_small":
    model = timm.create_model("vit_small_patch16_224", img_size=size, num_classes=0)
  elif case == "dino_vit_small":
    # DINO's vit_small has timm's modules, names and LayerNorm eps 1e-6; its forward is
    # _dino_vit_h.
    model = timm.models.vision_transformer.VisionTransformer(
      img_size=size, patch_size=16, embed_dim=384, depth=12, num_heads=6, num_classes=0
    )
  else:
    model = timm.models.vision_transformer.VisionTransformer(
      img_size=size, patch_size=16, embed_dim=384, depth=12, num_heads=12, num_classes=0
    )
    model.pos_embed.requires_grad = False
    model.pos_embed.data = _mocov3_pos_embed(torch, size // 16, 384)
  return model.eval()


def _dino_vit_h(model, x, torch):
  """DINO's VisionTransformer.forward on NCHW x: the class token's row of the last norm,
  the position embedding resized as its interpolate_pos_encoding does on another grid
  (bicubic, scale factor (grid + 0.1) / trained grid)."""
  tokens = model.patch_embed.proj(x).flatten(2).transpose(1, 2)
  tokens = torch.cat([model.cls_token.expand(len(x), -1, -1), tokens], 1)
  pos = model.pos_embed
  trained, grid = int(math.sqrt(pos.shape[1] - 1)), x.shape[-1] // 16
  if grid != trained:
    table = pos[:, 1:].reshape(1, trained, trained, -1).permute(0, 3, 1, 2)
    table = torch.nn.functional.interpolate(
      table, scale_factor=((grid + 0.1) / trained,) * 2, mode="bicubic"
    )
    pos = torch.cat([pos[:, :1], table.permute(0, 2, 3, 1).reshape(1, grid * grid, -1)], 1)
  tokens = tokens + pos
  for block in model.blocks:
    tokens = block(tokens)
  return model.norm(tokens)[:, 0]


def reference_h(case: str, state_dict: dict, torch, size: int = 0) -> np.ndarray:
  """h of the stock model with state_dict (numpy, loaded strictly) on the case's images (of
  `size` px if given)."""
  model = reference_model(case, torch)
  tensors = {k: torch.from_numpy(np.asarray(v)) for k, v in state_dict.items()}
  if case == "mocov3_vit_small":
    tensors["pos_embed"] = model.pos_embed.data
  model.load_state_dict(tensors, strict=True)
  x = torch.from_numpy(_standardised(case, size))
  with torch.no_grad():
    return (_dino_vit_h(model, x, torch) if case == "dino_vit_small" else model(x)).numpy()


def _outputs(case: str, state_dict: dict, torch) -> dict:
  """{'h': h at the case's size, and 'h_other' at OTHER_SIZES[case] if any}, float32."""
  out = {"h": reference_h(case, state_dict, torch)}
  if case in OTHER_SIZES:
    out["h_other"] = reference_h(case, state_dict, torch, OTHER_SIZES[case])
  return {k: v.astype(np.float32) for k, v in out.items()}


def main(argv):
  """make.py [OUT_DIR [--own-init]]: writes CASE.npz for every case to OUT_DIR (default:
  this folder); with --own-init also each stock model's own random initialisation,
  CASE.own.safetensors (for DINO's cases a main_dino.py checkpoint around it,
  CASE.own.pth, with its argparse arguments), and its outputs, CASE.own.npz (what the
  test runs live)."""
  import torch  # pylint: disable=import-outside-toplevel

  # torch's libraries before TensorFlow's: triton (imported through timm) crashes after it.
  for module in ("timm", "torchvision"):
    importlib.import_module(module)
  from contrastive_jax.core import tensor_files  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(2)
  folder = argv[1] if len(argv) > 1 else os.path.dirname(os.path.abspath(__file__))
  for case in CASES:
    out = _outputs(case, random_state_dict(case), torch)
    np.savez(os.path.join(folder, f"{case}.npz"), **out)
    print(f"{case}: h {out['h'].shape}, |h| max {np.abs(out['h']).max():.4g}", file=sys.stderr)
    if "--own-init" in argv:
      torch.manual_seed(CASES[case][2])
      own = {k: v.detach().numpy() for k, v in reference_model(case, torch).state_dict().items()}
      if case in DINO_TEACHER_PREFIX:
        checkpoint = _map_arrays(torch.from_numpy, dino_checkpoint(case, own))
        checkpoint["args"] = argparse.Namespace(arch=CASES[case][0]["name"], out_dim=128)
        torch.save(checkpoint, os.path.join(folder, f"{case}.own.pth"))
      else:
        tensor_files.write(os.path.join(folder, f"{case}.own.safetensors"), own)
      np.savez(os.path.join(folder, f"{case}.own.npz"), **_outputs(case, own, torch))


def _map_arrays(fn, tree):
  """fn applied to every numpy array of nested dicts (other leaves kept)."""
  if isinstance(tree, dict):
    return {k: _map_arrays(fn, v) for k, v in tree.items()}
  return fn(tree) if isinstance(tree, np.ndarray) else tree


if __name__ == "__main__":
  main(sys.argv)
