"""Makes the DINOv2 reference outputs that tests/test_dinov2.py compares with.

  /path/to/venv-with-torch/bin/python tests/reference_outputs/make_dinov2.py [OUT_DIR [--own-init]]

(with this repository on PYTHONPATH; needs the torch extra: torch, timm). For each
CASE (DINOv2's ViT-S/14 without and with 4 registers) the weights are drawn with
numpy from the case's seed in the reference's names (random_state_dict: no torch
needed, so the test draws the same ones), and the reference's forward pass runs on
them: dinov2 vision_transformer.py's DinoVisionTransformer.prepare_tokens_with_masks
and interpolate_pos_encoding transcribed in reference_tokens (torch's
F.interpolate, bicubic with the 0.1 offset in the scale factor without registers,
antialiased to the size with them, as dinov2's hub models are built), its blocks
and final norm timm's vit_small_patch14_dinov2 (the same modules, names and
LayerNorm eps 1e-6). The output is the final norm's tokens with the registers left
out, [2, 1 + grid^2, 384]: DINOv2's x_norm_clstoken and x_norm_patchtokens.
The models are ViT-S/14 at depth 12 with a position embedding trained for a
grid of 8 (112 px) rather than DINOv2's 37 (518 px), so that the outputs stay
small (CASE.npz, about 0.6 MB each): at 112 px and at SIZES' others, where the
embedding is interpolated down and up.

With --own-init, also timm's own random initialisation of its stock model of the
case (vit_small_patch14_dinov2 / vit_small_patch14_reg4_dinov2, timm's names:
reg_token, pos_embed without the class token's row for the _reg one), as
CASE.own.safetensors, and timm's forward_features on it at 112 px, CASE.own.npz;
and timm's checkpoint_filter_fn's conversion of the case's reference state dict
to timm's names, CASE.timm.safetensors, with timm's forward at 112 px in
CASE.own.npz's 'timm_tokens' (checking that the conversion keeps the function).
"""

import os
import sys

import ml_collections
import numpy as np

from contrastive_jax import recipes
from contrastive_jax.models import state_dicts

IMAGENET = dict(input_mean=recipes.IMAGENET_MEAN, input_std=recipes.IMAGENET_STD)
PATCH, GRID = 14, 8
# name -> (model config fields: the recipe's but the trained grid, timm's model, seed).
CASES = {
  case: (dict(recipes.dinov2_model(timm_name, "float32"), position_grid=GRID), timm_name, seed)
  for case, timm_name, seed in (
    ("dinov2_vit_small", "vit_small_patch14_dinov2", 214),
    ("dinov2_vit_small_reg4", "vit_small_patch14_reg4_dinov2", 2144),
  )
}
# The checkpoint's size first (no interpolation), then one smaller and one larger.
SIZES = (GRID * PATCH, 5 * PATCH, 11 * PATCH)


def model_config(case: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(CASES[case][0])


def images(case: str, size: int) -> np.ndarray:
  """Two uint8 [2, size, size, 3] images of the case, from its seed and the size."""
  rng = np.random.default_rng(CASES[case][2] + size)
  return rng.integers(0, 256, (2, size, size, 3), dtype=np.uint8)


def random_state_dict(case: str) -> dict:
  """The case's weights in DINOv2's names (mask_token included), float32 numpy, from its seed.

  Linears and the patch projection He-normal by fan-in, biases U(-0.2, 0.2),
  LayerNorm scales U(0.5, 1.5), layer-scale gammas U(0.2, 1) (not DINOv2's 1e-5
  initialisation, so that the blocks matter), the class token, registers and
  position embedding normal(0, 1) (so that a misplaced or misinterpolated one shows).
  """
  config = model_config(case)
  rng = np.random.default_rng(CASES[case][2])
  out = {}
  for entry, shape in state_dicts.torch_shapes(config, SIZES[0]):
    if entry.layout in ("conv", "dense"):
      value = rng.normal(size=shape) * np.sqrt(2.0 / np.prod(shape[1:]))
    elif entry.name.endswith(".gamma"):
      value = rng.uniform(0.2, 1.0, shape)
    elif entry.path[-1:] == ("scale",):
      value = rng.uniform(0.5, 1.5, shape)
    elif entry.path[-1:] == ("bias",):
      value = rng.uniform(-0.2, 0.2, shape)
    else:  # cls_token, register_tokens, pos_embed, mask_token
      value = rng.normal(size=shape)
    out[entry.name] = value.astype(np.float32)
  return out


def _standardised(case: str, size: int) -> np.ndarray:
  """The case's images as the reference's input: NCHW float32, ImageNet-standardised."""
  x = images(case, size).astype(np.float32) / 255.0
  x = (x - np.float32(IMAGENET["input_mean"])) / np.float32(IMAGENET["input_std"])
  return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def _timm_without_registers(timm):
  """timm's vit_small_patch14_dinov2 (class token with its position embedding, layer
  scale) at the checkpoint's size, in eval mode: the reference's blocks and norm."""
  return timm.create_model(
    "vit_small_patch14_dinov2", img_size=SIZES[0], num_classes=0, pretrained=False
  ).eval()


def reference_tokens(case: str, state_dict: dict, torch, timm, size: int) -> np.ndarray:
  """float32 [2, 1 + (size/14)^2, 384]: DINOv2's final-norm class and patch tokens of the
  case's images at `size` px, the model holding state_dict (numpy, DINOv2's names)."""
  config = CASES[case][0]
  model = _timm_without_registers(timm)
  tensors = {
    k: torch.from_numpy(v)
    for k, v in state_dict.items()
    if k not in ("mask_token", "register_tokens")
  }
  model.load_state_dict(tensors, strict=True)
  x = torch.from_numpy(_standardised(case, size))
  with torch.no_grad():
    _, _, w, h = x.shape
    tokens = model.patch_embed.proj(x).flatten(2).transpose(1, 2)
    tokens = torch.cat([model.cls_token.expand(len(x), -1, -1), tokens], 1)
    # interpolate_pos_encoding, as dinov2's hub builds the models: interpolate_offset 0.1
    # and no antialiasing without registers, offset 0 (the size) and antialiasing with.
    pos = model.pos_embed.float()
    n, dim = pos.shape[1] - 1, pos.shape[2]
    trained, w0, h0 = int(n**0.5), w // PATCH, h // PATCH
    if not (tokens.shape[1] - 1 == n and w == h):
      offset = 0.0 if config["registers"] else 0.1
      kwargs = (
        dict(scale_factor=((w0 + offset) / trained, (h0 + offset) / trained))
        if offset
        else dict(size=(w0, h0))
      )
      table = torch.nn.functional.interpolate(
        pos[:, 1:].reshape(1, trained, trained, dim).permute(0, 3, 1, 2),
        mode="bicubic",
        antialias=bool(config["registers"]),
        **kwargs,
      )
      assert tuple(table.shape[-2:]) == (w0, h0)
      pos = torch.cat([pos[:, :1], table.permute(0, 2, 3, 1).reshape(1, -1, dim)], 1)
    tokens = tokens + pos
    registers = config["registers"]
    if registers:
      reg = torch.from_numpy(state_dict["register_tokens"]).expand(len(x), -1, -1)
      tokens = torch.cat([tokens[:, :1], reg, tokens[:, 1:]], 1)
    for block in model.blocks:
      tokens = block(tokens)
    tokens = model.norm(tokens)
    return torch.cat([tokens[:, :1], tokens[:, 1 + registers :]], 1).numpy().astype(np.float32)


def _timm_tokens(case: str, model, torch) -> np.ndarray:
  """timm's forward_features at the checkpoint's size, registers left out."""
  registers = CASES[case][0]["registers"]
  with torch.no_grad():
    tokens = model.forward_features(torch.from_numpy(_standardised(case, SIZES[0])))
  return torch.cat([tokens[:, :1], tokens[:, 1 + registers :]], 1).numpy().astype(np.float32)


def main(argv):
  """make_dinov2.py [OUT_DIR [--own-init]]: CASE.npz ({'tokens_S'} for each of SIZES) to
  OUT_DIR (default: this folder); with --own-init also CASE.own.safetensors,
  CASE.timm.safetensors and CASE.own.npz (see the module docstring)."""
  # torch's libraries before TensorFlow's: triton (imported through timm) crashes after it.
  import timm  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel

  from contrastive_jax.core import tensor_files  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(2)
  folder = argv[1] if len(argv) > 1 else os.path.dirname(os.path.abspath(__file__))
  for case in CASES:
    reference = random_state_dict(case)
    out = {f"tokens_{s}": reference_tokens(case, reference, torch, timm, s) for s in SIZES}
    np.savez(os.path.join(folder, f"{case}.npz"), **out)
    print(f"{case}: {[v.shape for v in out.values()]}", file=sys.stderr)
    if "--own-init" in argv:
      torch.manual_seed(CASES[case][2])
      stock = timm.create_model(CASES[case][1], img_size=SIZES[0], num_classes=0).eval()
      own = {k: v.detach().numpy() for k, v in stock.state_dict().items()}
      tensor_files.write(os.path.join(folder, f"{case}.own.safetensors"), own)
      own_tokens = _timm_tokens(case, stock, torch)
      converted = timm.models.vision_transformer.checkpoint_filter_fn(
        {k: torch.from_numpy(v) for k, v in reference.items()}, stock
      )
      stock.load_state_dict(converted, strict=True)
      tensor_files.write(
        os.path.join(folder, f"{case}.timm.safetensors"),
        {k: v.numpy() for k, v in converted.items()},
      )
      np.savez(
        os.path.join(folder, f"{case}.own.npz"),
        tokens=own_tokens,
        timm_tokens=_timm_tokens(case, stock, torch),
      )


if __name__ == "__main__":
  main(sys.argv)
