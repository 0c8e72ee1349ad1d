"""A DINOv2 backbone (Oquab et al. 2024, arXiv 2304.07193; Darcet et al. 2024, arXiv
2309.16588 for the _reg4 ones; facebookresearch/dinov2) as the pretraining config of a
weights file: what the linear probe, fine-tuning, label-efficiency and embed jobs read
with --config.pretrain_workdir=FILE --config.pretrain_config=configs/dinov2.py:MODEL.

FILE is a published backbone (dinov2_vits14_pretrain.pth, dinov2_vits14_reg4_pretrain.pth,
..., or timm's vit_*_patch14_dinov2 safetensors); nothing is downloaded.

Arguments (--config.pretrain_config=configs/dinov2.py:ARG,ARG...):
  `model=vit_small_patch14_dinov2` (the default) or any recipes.DINOV2_MODELS name:
      vit_{small,base,large,giant}_patch14{,_reg4}_dinov2;
  `image_size=224` (the default) or 448, 518: the images' side (a multiple of 14); the
      position embedding, trained for 518 px, is interpolated as the reference does;
  `dtype=bfloat16` (the default) or `dtype=float32`.

The evaluation crop is DINOv2's (recipes.foundation_backbone: resize the shorter side to 256
bicubic, centre crop 224: fraction 0.875), ImageNet standardisation. The method is DINO's,
so that the probe's `auto` preset is DINO's. DINOv3's ViTs: configs/dinov3.py.

The files, the architecture and the refusals: docs/weights.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(
  model=tuple(recipes.DINOV2_MODELS),
  image_size=(224, 448, 518),
  dtype=("bfloat16", "float32"),
)
VARIANTS = {name: f"model={name}" for name in recipes.DINOV2_MODELS}


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS, VARIANTS)
  return recipes.foundation_backbone(
    recipes.base_config(), recipes.dinov2_model(args.model, args.dtype), args.image_size
  )
