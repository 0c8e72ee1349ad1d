"""MoCo v3 on ImageNet (Chen, Xie and He 2021, arXiv 2104.02057; facebookresearch/moco-v3).

Arguments (--config=configs/mocov3_imagenet.py:ARG,ARG..., e.g. :model=resnet50,epochs=1000):
  `model=vit_base` (the default), `model=vit_small` or `model=resnet50`;
  `epochs=300` (the default), `epochs=100` or `epochs=1000`: the ResNet-50 runs the
      reference's preset for that length (below), a ViT its one recipe for that long;
  `dtype=bfloat16` (the default) or `dtype=float32`: the encoder's compute dtype.
Variants, named by what they reproduce (top-1 of MoCo v3's linear
classification, main_lincls.py: the `mocov3` probe preset, with --config.
optimizer.base_lr=3 for the ViTs as CONFIG.md's ViT commands), from the
reference's CONFIG.md (its README's tables, batch 4096):
  `vit_base` (model=vit_base, the default): ViT-B/16, 300 epochs: 76.7%;
  `vit_small` (model=vit_small): ViT-S/16 (MoCo v3's, 12 heads), 300 epochs: 73.2%;
  `resnet50` (model=resnet50,epochs=100): ResNet-50, 100 epochs: 68.9% (main_moco.py's
      defaults: lr 0.6, weight decay 1e-6, m 0.99);
  `resnet50_300ep` (model=resnet50,epochs=300): 72.8% (lr 0.3);
  `resnet50_1000ep` (model=resnet50,epochs=1000): 74.6% (lr 0.3, weight decay 1.5e-6,
      m 0.996).
ViT recipe (CONFIG.md): batch 4096, AdamW lr 1.5e-4 x B/256 (betas 0.9, 0.999),
weight decay 0.1, 40 warm-up epochs then cosine, 300 epochs, t 0.2, momentum
0.99 ramped to 1 (--moco-m-cos), random (frozen) patch projection
(--stop-grad-conv1), patch 16 at 224 px, projector 3 layers (4096, 4096, 256),
RandomResizedCrop scale 0.08-1 (main_moco.py's default --crop-min). One
difference, as timm's param_groups_weight_decay: weight decay leaves biases, LayerNorm, the class
token out ('kernels'); the reference's torch.optim.AdamW decays every parameter
('all' reproduces it). ResNet recipe: LARS (MoCo v3's: weight decay and trust
ratio 0.001 on weights of more than one dimension, momentum 0.9, lr after the
momentum), 10 warm-up epochs then cosine, t 1.0, torchvision's ResNet-50 with
zero_init_residual=True, projector 2 layers (4096, 256), crop scale 0.2-1
(CONFIG.md's --crop-min=.2). Both: predictor 2 layers (4096, 256), ending in
a BN without affine parameters for the ViT (builder.py's MoCo_ViT keeps
_build_mlp's last_bn=True; MoCo_ResNet passes False), every Linear without
bias (PyTorch's nn.Linear initialisation), BN after each hidden Linear and
after the projector's last one (without affine parameters), global BN, each
view its own forward pass; BYOL's asymmetric views with torchvision's
ColorJitter (0.4, 0.4, 0.2, 0.1) p 0.8, grayscale p 0.2, PIL blur p 1.0 / 0.1,
solarize p 0 / 0.2, flip; ImageNet standardisation; bfloat16 compute.

The recipes and their sources: docs/recipes.md; the runs measured: docs/results.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

# epochs -> the ResNet-50's (base lr, weight decay, momentum).
RESNET50 = {100: (0.6, 1e-6, 0.99), 300: (0.3, 1e-6, 0.99), 1000: (0.3, 1.5e-6, 0.996)}
ARGS = dict(
  model=("vit_base", "vit_small", "resnet50"),
  epochs=(300, 100, 1000),
  dtype=("bfloat16", "float32"),
)
VARIANTS = {
  "vit_base": "model=vit_base",
  "vit_small": "model=vit_small",
  "resnet50": "model=resnet50,epochs=100",
  "resnet50_300ep": "model=resnet50,epochs=300",
  "resnet50_1000ep": "model=resnet50,epochs=1000",
}


def mlp(hidden_dims, last_bn: bool) -> dict:
  """MoCo v3's _build_mlp: Linear (no bias), BN, ReLU per hidden layer, then a Linear
  (no bias) and, with last_bn, a BN without affine parameters."""
  return dict(
    hidden_dims=tuple(hidden_dims),
    out_dim=256,
    use_bn=True,
    final_bn=last_bn,
    final_bn_scale=False,
    final_bias=False,
    init="torch",
  )


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS, VARIANTS)
  config = recipes.base_config()
  config.method = "mocov3"
  config.augment = recipes.mocov3_views()
  recipes.imagenet(config, batch_size=4096, num_epochs=args.epochs, reference="torchvision")
  if args.model == "resnet50":
    base_lr, weight_decay, momentum = RESNET50[args.epochs]
    config.model.zero_init_residual = True
    config.projector = mlp((4096,), last_bn=True)
    config.predictor = mlp((4096,), last_bn=False)  # MoCo_ResNet passes last_bn=False.
    config.temperature = 1.0
    config.moco = dict(momentum=momentum, momentum_schedule="cosine")
    config.crop = recipes.crop("torchvision", 0.2, "pil_bilinear")
    config.optimizer = recipes.optimizer("lars", base_lr=base_lr, weight_decay=weight_decay)
  else:
    config.model = recipes.vit_model(args.model, 16, "bfloat16", random_patch_projection=True)
    config.projector = mlp((4096, 4096), last_bn=True)
    config.predictor = mlp((4096,), last_bn=True)  # MoCo_ViT keeps _build_mlp's last_bn=True.
    config.temperature = 0.2
    config.moco = dict(momentum=0.99, momentum_schedule="cosine")
    config.crop = recipes.crop("torchvision", 0.08, "pil_bilinear")
    config.optimizer = recipes.optimizer(
      "adamw", base_lr=1.5e-4, weight_decay=0.1, warmup_epochs=40
    )
  config.model.dtype = args.dtype
  return config
