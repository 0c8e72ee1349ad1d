"""MoCo v1 on ImageNet (He et al. 2019, arXiv 1911.05722; facebookresearch/moco).

Targets 60.6% top-1 of main_lincls.py's linear classifier (the `moco` probe
preset) on the frozen ResNet-50 (the paper's Table 1; the README: 60.8 +-
0.2). Recipe (main_moco.py defaults): batch 256, SGD lr 0.03, momentum 0.9,
weight decay 1e-4 on every parameter, 200 epochs with lr x0.1 at 120 and 160,
queue 65536, key momentum 0.999, temperature 0.07, a linear 128-d head with
nn.Linear's initialisation, torchvision's ResNet (He-normal convs, last BN
scale 1), ImageNet standardisation, shuffle BN over BN groups of 32 images
(8 GPUs x 32), RandomResizedCrop (scale 0.2-1, bilinear), grayscale p 0.2
then torchvision's ColorJitter(0.4, 0.4, 0.4, 0.4) always, flip; bfloat16.

Arguments (--config=configs/moco_v1_imagenet.py:ARG):
  `dtype=bfloat16` (the default) or `dtype=float32`: the encoder's compute dtype.

The recipes and their sources: docs/recipes.md; the runs measured: docs/results.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(dtype=("bfloat16", "float32"))


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS)
  config = recipes.imagenet(
    recipes.base_config(), batch_size=256, num_epochs=200, reference="torchvision"
  )
  config.method = "moco"
  config.projector = dict(hidden_dims=(), out_dim=128, use_bn=False, init="torch")
  config.temperature = 0.07
  config.moco = dict(
    queue_size=65536, momentum=0.999, momentum_schedule="constant", bn_group_size=32
  )
  config.crop = recipes.crop("torchvision", 0.2, "pil_bilinear")
  config.augment = dict(view1=recipes.moco_v1_view(), view2=recipes.moco_v1_view())
  config.optimizer = recipes.optimizer(
    "sgd",
    base_lr=0.03,
    weight_decay=1e-4,
    warmup_epochs=0,
    schedule="step",
    decay_epochs=(120, 160),
    weight_decay_mask="all",
  )
  config.model.dtype = args.dtype
  return config
