"""Makes the DINOv3 reference outputs that tests/test_dinov3.py compares with.

  /path/to/venv-with-torch/bin/python tests/reference_outputs/make_dinov3.py [OUT_DIR]
      [--own-init] [--dinov3-source=PATH]

(with this repository on PYTHONPATH; needs the torch extra: torch, timm). The weights of
DINOv3's ViT-S/16 (dinov3 hub/backbones.py dinov3_vits16: 6 heads, 4 storage tokens, layer
scale, the masked key bias, LayerNorm eps 1e-5, RoPE of base 100), reduced to DEPTH blocks of
its 12 (the reference's builder and timm's take the depth), are drawn
with numpy from the case's seed in the reference's names (random_state_dict: no torch
needed, so the test draws the same ones), and the reference's forward pass runs on them:
dinov3 models/vision_transformer.py's DinoVisionTransformer.forward_features in evaluation,
with layers/rope_position_encoding.py's RopePositionEmbedding (normalize_coords
'separate'), layers/attention.py's LinearKMaskedBias and rope_apply and layers/block.py's
SelfAttentionBlock, transcribed on torch's functional operations in reference_tokens. The
outputs are the final norm's class and patch tokens, [2, 1 + grid^2, 384] (DINOv3's
x_norm_clstoken and x_norm_patchtokens), and its storage tokens, [2, 4, 384]
(x_storage_tokens), at each of SIZES (RoPE has no trained grid: 224 px, the hub's, and 96
px): CASE.npz, about 0.75 MB.

The script also checks that timm's DINOv3 (eva.py vit_small_patch16_dinov3_qkvb, loaded
with timm's checkpoint_filter_fn's conversion of the reference's state dict) gives the same
tokens; with --dinov3-source=PATH (a checkout of facebookresearch/dinov3), that the
reference's own DinoVisionTransformer (dinov3_vits16's arguments, the state dict loaded
strictly) does.

With --own-init, also timm's own random initialisation of its stock models
(vit_small_patch16_dinov3_qkvb, with q_bias / v_bias, and vit_small_patch16_dinov3, without a
qkv bias; timm's names) as CASE.own.safetensors / CASE.own_nobias.safetensors, the case's
reference state dict in timm's names as timm's conversion writes it,
CASE.timm.safetensors, and timm's forward_features of each at 224 px, CASE.own.npz.
"""

import math
import os
import sys

import ml_collections
import numpy as np

from contrastive_jax import recipes
from contrastive_jax.models import state_dicts

PATCH, HEADS, STORAGE, EPSILON, ROPE_BASE = 16, 6, 4, 1e-5, 100.0
DEPTH = 3  # Of the published 12 blocks: the tests' compilations stay short.
CASES = {
  "dinov3_vit_small": (
    dict(recipes.dinov3_model("vit_small_patch16_dinov3", "float32"), depth=DEPTH),
    316,
  ),
}
# The hub's size first, then one smaller: RoPE works on any grid.
SIZES = (224, 96)
TOLERANCE = 1e-5  # Relative: max |t - t_ref| / max |t_ref|, float32.
TIMM_MODELS = {"own": "vit_small_patch16_dinov3_qkvb", "own_nobias": "vit_small_patch16_dinov3"}


def model_config(case: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(CASES[case][0])


def images(case: str, size: int) -> np.ndarray:
  """Two uint8 [2, size, size, 3] images of the case, from its seed and the size."""
  rng = np.random.default_rng(CASES[case][1] + size)
  return rng.integers(0, 256, (2, size, size, 3), dtype=np.uint8)


def random_state_dict(case: str) -> dict:
  """The case's weights in DINOv3's names, float32 numpy, from its seed.

  As make_dinov2.random_state_dict's (Linears and the patch projection He-normal by fan-in,
  biases U(-0.2, 0.2), the key third of qkv's included, so that its mask matters; LayerNorm
  scales U(0.5, 1.5), layer-scale gammas U(0.2, 1), the class, storage and mask tokens
  normal(0, 1)); rope_embed.periods base^(2 i / (head_dim / 2)) computed in float32 as the
  reference's _init_weights; each block's bias_mask 1, 0, 1 on the thirds as its
  init_weights_vit.
  """
  config = model_config(case)
  rng = np.random.default_rng(CASES[case][1])
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
    else:  # cls_token, storage_tokens, mask_token
      value = rng.normal(size=shape)
    out[entry.name] = value.astype(np.float32)
  d = out["cls_token"].shape[-1]
  head_dim = d // HEADS
  quarter = np.arange(head_dim // 4, dtype=np.float32)
  out["rope_embed.periods"] = (np.float32(ROPE_BASE) ** (2 * quarter / (head_dim // 2))).astype(
    np.float32
  )
  mask = np.ones(3 * d, np.float32)
  mask[d : 2 * d] = 0
  for i in range(config.depth):
    out[f"blocks.{i}.attn.qkv.bias_mask"] = mask
  return out


def _standardised(case: str, size: int) -> np.ndarray:
  """The case's images as the reference's input: NCHW float32, ImageNet-standardised."""
  x = images(case, size).astype(np.float32) / 255.0
  x = (x - np.float32(recipes.IMAGENET_MEAN)) / np.float32(recipes.IMAGENET_STD)
  return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def split_tokens(tokens: np.ndarray) -> tuple:
  """Final-norm tokens [N, 1 + 4 + grid^2, D] -> (class and patches, storage)."""
  return (
    np.concatenate([tokens[:, :1], tokens[:, 1 + STORAGE :]], axis=1).astype(np.float32),
    tokens[:, 1 : 1 + STORAGE].astype(np.float32),
  )


def reference_tokens(case: str, state_dict: dict, torch, size: int) -> np.ndarray:
  """float32 [2, 1 + 4 + (size/16)^2, 384]: DINOv3's final-norm tokens (class, storage,
  patches) of the case's images at `size` px, the model holding state_dict (numpy, DINOv3's
  names); see the module docstring."""
  F = torch.nn.functional
  t = {k: torch.from_numpy(v) for k, v in state_dict.items()}
  norm = lambda x, name: F.layer_norm(
    x, x.shape[-1:], t[f"{name}.weight"], t[f"{name}.bias"], eps=EPSILON
  )
  linear = lambda x, name, bias=None: F.linear(
    x, t[f"{name}.weight"], t[f"{name}.bias"] if bias is None else bias
  )
  with torch.no_grad():
    x = F.conv2d(
      torch.from_numpy(_standardised(case, size)),
      t["patch_embed.proj.weight"],
      t["patch_embed.proj.bias"],
      stride=PATCH,
    )
    n, d, h, w = x.shape
    x = x.flatten(2).transpose(1, 2)  # [N, HW, D], row-major
    cls = t["cls_token"] + 0 * t["mask_token"]
    x = torch.cat([cls.expand(n, -1, -1), t["storage_tokens"].expand(n, -1, -1), x], 1)
    # RopePositionEmbedding.forward, 'separate', in evaluation, float32.
    coords_h = torch.arange(0.5, h, dtype=torch.float32) / h
    coords_w = torch.arange(0.5, w, dtype=torch.float32) / w
    coords = torch.stack(torch.meshgrid(coords_h, coords_w, indexing="ij"), -1).flatten(0, 1)
    coords = 2.0 * coords - 1.0
    angles = 2 * math.pi * coords[:, :, None] / t["rope_embed.periods"][None, None, :]
    angles = angles.flatten(1, 2).tile(2)  # [HW, head_dim]
    sin, cos = torch.sin(angles), torch.cos(angles)

    def rope(y):  # rope_apply on the patches, [N, heads, T, head_dim]
      prefix = y.shape[2] - sin.shape[0]
      half1, half2 = y[:, :, prefix:].chunk(2, dim=-1)
      rotated = torch.cat([-half2, half1], dim=-1)
      return torch.cat([y[:, :, :prefix], y[:, :, prefix:] * cos + rotated * sin], 2)

    for i in range(model_config(case).depth):
      b = f"blocks.{i}"
      masked = t[f"{b}.attn.qkv.bias"] * t[f"{b}.attn.qkv.bias_mask"]
      qkv = linear(norm(x, f"{b}.norm1"), f"{b}.attn.qkv", masked)
      q, k, v = qkv.reshape(n, x.shape[1], 3, HEADS, d // HEADS).unbind(2)
      q, k, v = (y.transpose(1, 2) for y in (q, k, v))
      out = F.scaled_dot_product_attention(rope(q), rope(k), v)
      out = linear(out.transpose(1, 2).reshape(n, x.shape[1], d), f"{b}.attn.proj")
      x = x + t[f"{b}.ls1.gamma"] * out
      y = linear(F.gelu(linear(norm(x, f"{b}.norm2"), f"{b}.mlp.fc1")), f"{b}.mlp.fc2")
      x = x + t[f"{b}.ls2.gamma"] * y
    return norm(x, "norm").numpy().astype(np.float32)


def _relative(value, ref) -> float:
  return float(np.max(np.abs(value - ref)) / np.max(np.abs(ref)))


def _timm_tokens(case: str, model, torch, size: int) -> np.ndarray:
  """timm's forward_features (final-norm tokens with the storage ones) at `size` px."""
  with torch.no_grad():
    return model.forward_features(torch.from_numpy(_standardised(case, size))).numpy()


def _dinov3_source_tokens(case: str, state_dict: dict, torch, size: int, source: str):
  """The reference's own DinoVisionTransformer (a checkout at `source`) with hub/backbones.py
  dinov3_vits16's arguments but DEPTH blocks, on state_dict."""
  sys.path.insert(0, source)
  from dinov3.models import vision_transformer  # pylint: disable=import-outside-toplevel

  model = vision_transformer.DinoVisionTransformer(
    patch_size=PATCH,
    pos_embed_rope_base=ROPE_BASE,
    pos_embed_rope_normalize_coords="separate",
    pos_embed_rope_rescale_coords=2,
    pos_embed_rope_dtype="fp32",
    embed_dim=384,
    depth=DEPTH,
    num_heads=HEADS,
    ffn_ratio=4,
    qkv_bias=True,
    layerscale_init=1.0e-05,
    norm_layer="layernormbf16",
    ffn_layer="mlp",
    n_storage_tokens=STORAGE,
    mask_k_bias=True,
  ).eval()
  model.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
  with torch.no_grad():
    out = model.forward_features(torch.from_numpy(_standardised(case, size)))
  return np.concatenate(
    [out["x_norm_clstoken"][:, None], out["x_storage_tokens"], out["x_norm_patchtokens"]], 1
  )


def main(argv):
  """make_dinov3.py [OUT_DIR] [--own-init] [--dinov3-source=PATH]: see the module docstring."""
  # torch's libraries before TensorFlow's: triton (imported through timm) crashes after it.
  import timm  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel

  from contrastive_jax.core import tensor_files  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(2)
  positional = [a for a in argv[1:] if not a.startswith("--")]
  folder = positional[0] if positional else os.path.dirname(os.path.abspath(__file__))
  source = next((a.split("=", 1)[1] for a in argv if a.startswith("--dinov3-source=")), None)
  for case in CASES:
    reference = random_state_dict(case)
    tokens = {s: reference_tokens(case, reference, torch, s) for s in SIZES}
    stock = timm.create_model(TIMM_MODELS["own"], num_classes=0, depth=DEPTH).eval()
    converted = timm.models.eva.checkpoint_filter_fn(
      {k: torch.from_numpy(v) for k, v in reference.items()}, stock
    )
    stock.load_state_dict(converted, strict=True)
    for s in SIZES:
      deviation = _relative(_timm_tokens(case, stock, torch, s), tokens[s])
      print(f"{case} {s} px: timm's DINOv3 deviates by {deviation:.2g}", file=sys.stderr)
      assert deviation < TOLERANCE, deviation
      if source:
        deviation = _relative(_dinov3_source_tokens(case, reference, torch, s, source), tokens[s])
        print(f"{case} {s} px: dinov3's own deviates by {deviation:.2g}", file=sys.stderr)
        assert deviation < TOLERANCE, deviation
    out = {}
    for s in SIZES:
      out[f"tokens_{s}"], out[f"storage_{s}"] = split_tokens(tokens[s])
    np.savez(os.path.join(folder, f"{case}.npz"), **out)
    print(f"{case}: {[v.shape for v in out.values()]}", file=sys.stderr)
    if "--own-init" in argv:
      own = dict(timm=_timm_tokens(case, stock, torch, SIZES[0]))
      tensor_files.write(
        os.path.join(folder, f"{case}.timm.safetensors"),
        {k: v.numpy() for k, v in converted.items()},
      )
      for name, timm_name in TIMM_MODELS.items():
        torch.manual_seed(CASES[case][1])
        model = timm.create_model(timm_name, num_classes=0, depth=DEPTH).eval()
        tensor_files.write(
          os.path.join(folder, f"{case}.{name}.safetensors"),
          {k: v.detach().numpy() for k, v in model.state_dict().items()},
        )
        own[name] = _timm_tokens(case, model, torch, SIZES[0])
      np.savez(os.path.join(folder, f"{case}.own.npz"), **own)


if __name__ == "__main__":
  main(sys.argv)
