"""MoCo v2 on ImageNet (Chen et al. 2020b, arXiv 2003.04297; facebookresearch/moco).

Arguments (--config=configs/moco_v2_imagenet.py:ARG,ARG..., e.g. :epochs=800), named
by what they reproduce (top-1 of main_lincls.py's linear classifier, the `moco`
probe preset, on the frozen ResNet-50):
  `epochs=200` (the default; variant `200ep`): 67.5% (the paper's Table 2; the
      README: 67.7 +- 0.1), 53 h on 8 V100 there;
  `epochs=800` (variant `800ep`): 71.1% (the paper's Table 2 and the README), the
      same recipe for 800 epochs;
  `dtype=bfloat16` (the default) or `dtype=float32`: the encoder's compute dtype.
Recipe (main_moco.py --mlp --moco-t 0.2 --aug-plus --cos): batch 256, SGD lr
0.03, momentum 0.9, weight decay 1e-4 on every parameter, cosine schedule
without warm-up, queue 65536, key momentum 0.999, temperature 0.2, MLP head
(2048, ReLU, 128) with nn.Linear's initialisation, torchvision's ResNet
(He-normal convs, last BN scale 1), ImageNet standardisation, shuffle BN over
BN groups of 32 images (the reference's 8 GPUs x 32), RandomResizedCrop
(scale 0.2-1, bilinear), torchvision's ColorJitter(0.4, 0.4, 0.4, 0.1) p 0.8,
grayscale p 0.2, Gaussian blur p 0.5, flip; bfloat16.

The recipes and their sources: docs/recipes.md; the runs measured: docs/results.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(epochs=(200, 800), dtype=("bfloat16", "float32"))
VARIANTS = {"200ep": "epochs=200", "800ep": "epochs=800"}


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS, VARIANTS)
  config = recipes.imagenet(
    recipes.base_config(), batch_size=256, num_epochs=args.epochs, reference="torchvision"
  )
  config.method = "moco"
  config.projector = dict(hidden_dims=(2048,), out_dim=128, use_bn=False, init="torch")
  config.temperature = 0.2
  config.moco = dict(
    queue_size=65536, momentum=0.999, momentum_schedule="constant", bn_group_size=32
  )
  config.crop = recipes.crop("torchvision", 0.2, "pil_bilinear")
  config.augment = dict(view1=recipes.moco_v2_view(0.5), view2=recipes.moco_v2_view(0.5))
  config.optimizer = recipes.optimizer(
    "sgd", base_lr=0.03, weight_decay=1e-4, warmup_epochs=0, weight_decay_mask="all"
  )
  config.model.dtype = args.dtype
  return config
