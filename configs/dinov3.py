"""A DINOv3 ViT (Simeoni et al. 2025, arXiv 2508.10104; facebookresearch/dinov3) as the
pretraining config of a weights file: what the linear probe, fine-tuning, label-efficiency
and embed jobs read with --config.pretrain_workdir=FILE
--config.pretrain_config=configs/dinov3.py:MODEL.

FILE is a published backbone (dinov3_vits16_pretrain_lvd1689m-08c60483.pth,
dinov3_vitb16_pretrain_lvd1689m-73cec8be.pth, dinov3_vitl16_pretrain_lvd1689m-8aa4cbdd.pth, or
timm's vit_*_patch16_dinov3{,_qkvb} safetensors); nothing is downloaded.

Arguments (--config.pretrain_config=configs/dinov3.py:ARG,ARG...):
  `model=vit_small_patch16_dinov3` (the default) or any recipes.DINOV3_MODELS name:
      vit_{small,base,large}_patch16_dinov3;
  `image_size=224` (the default) or 256, 448, 512: the images' side (a multiple of 16); RoPE
      has no trained grid, any works;
  `dtype=bfloat16` (the default) or `dtype=float32`.

The evaluation crop is DINOv3's (recipes.foundation_backbone: resize the shorter side to 256
bicubic, centre crop 224: fraction 0.875, dinov3 data/transforms.py), ImageNet
standardisation. The method is DINO's, so that the probe's `auto` preset is DINO's.

The files, the architecture and the refusals: docs/weights.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(
  model=tuple(recipes.DINOV3_MODELS),
  image_size=(224, 256, 448, 512),
  dtype=("bfloat16", "float32"),
)
VARIANTS = {name: f"model={name}" for name in recipes.DINOV3_MODELS}


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS, VARIANTS)
  return recipes.foundation_backbone(
    recipes.base_config(), recipes.dinov3_model(args.model, args.dtype), args.image_size
  )
