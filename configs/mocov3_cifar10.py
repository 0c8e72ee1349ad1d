"""MoCo v3 on CIFAR-10: solo-learn's recipe (vturrisi/solo-learn,
scripts/pretrain/cifar/mocov3.yaml with augmentations/asymmetric.yaml) with MoCo
v3's own heads.

MoCo v3 publishes no CIFAR-10 recipe; solo-learn's is the one a peer library
runs (1000 epochs; its README's CIFAR-10 table gives its linear accuracy, not
re-checked here). The recipe: ResNet-18 with a 3x3 stride-1 stem and no
max-pool, torchvision's initialisation, projector Linear 4096, BN, ReLU, Linear
256, BN without affine parameters; predictor Linear 4096, BN, ReLU, Linear 256
(moco-v3 builder.py's _build_mlp: Linears without bias, nn.Linear's
initialisation), global BN, each view its own forward pass, t 0.2, momentum
0.99 ramped to 1 (cosine), batch 256, LARS with LARC's clipping (eta 0.02,
biases and BN excluded), lr 0.3 x B/256, weight decay 1e-6, 10 warm-up epochs
then cosine; views: RandomResizedCrop(32) (scale 0.08-1, bicubic),
torchvision's ColorJitter(0.4, 0.4, 0.2, 0.1) p 0.8, grayscale p 0.2, no blur,
solarize view 2 with p 0.2, flip; inputs standardised with solo-learn's
CIFAR-10 mean and std.

Arguments (--config=configs/mocov3_cifar10.py:ARG,ARG..., e.g. :model=vit_tiny,runlocal):
  `runlocal`: the same job shrunk for a 2-core CPU (recipes.runlocal: ResNet-18 at
      width 0.25 with the ImageNet stem, batch 256, 1500 steps), with narrower heads
      (512 hidden, 128 out). A step costs about a BYOL runlocal step (four forward
      passes, two backward).
  `model=resnet18` (the default) or `model=vit_tiny`: a ViT-Tiny (vit_tiny's 3 heads,
      D 192, 12 blocks) at patch 4 on the 32 px images (64 patches and the class
      token), with MoCo v3's ViT optimisation (AdamW lr 1.5e-4 x B/256, weight decay
      0.1 on kernels, 40 warm-up epochs then cosine, random frozen patch projection)
      and its predictor's last BN without affine parameters (MoCo_ViT, builder.py);
      data, views, heads and t 0.2 as the ResNet's recipe. No reference publishes
      this recipe for CIFAR-10. With runlocal, the ViT is shrunk so that a step is
      cheap on 2 CPU cores: D 96 (width 0.5), 4 blocks, patch 8 (attention over 17
      tokens; patch 4 would make 65 and a step about 4x dearer), 800 steps (a step
      costs 1.3 CPU-seconds here, about twice the ResNet's), evaluators every 400,
      a base learning rate of 1e-3 x B/256, 6.7x MoCo v3's 1.5e-4 (at batch 256 the
      step is still below the 2.4e-3 of its batch-4096 runs), and a warm-up of half
      an epoch (98 steps) instead of 40 epochs: a ViT learns slowly from few images
      and few steps, and the short run leaves no room for a long warm-up.
  `dtype=float32` (the default) or `dtype=bfloat16`: the encoder's compute dtype.
Variant `runlocal_vit`: runlocal,model=vit_tiny.

The recipes and their sources: docs/recipes.md; the runs measured: docs/results.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(runlocal=False, model=("resnet18", "vit_tiny"), dtype=("float32", "bfloat16"))
VARIANTS = {"runlocal_vit": "runlocal,model=vit_tiny"}


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS, VARIANTS)
  config = recipes.base_config()
  config.method = "mocov3"
  config.batch_size = 256
  config.duration = "1000 epochs"
  config.model = recipes.model("resnet18", "cifar", "float32", "torchvision")
  config.model.input_mean = (0.4914, 0.4822, 0.4465)
  config.model.input_std = (0.247, 0.243, 0.261)
  head = dict(use_bn=True, final_bn_scale=False, final_bias=False, init="torch")
  config.projector = dict(hidden_dims=(4096,), out_dim=256, final_bn=True, **head)
  config.predictor = dict(hidden_dims=(4096,), out_dim=256, final_bn=False, **head)
  config.temperature = 0.2
  config.moco = dict(momentum=0.99, momentum_schedule="cosine")
  config.crop = recipes.crop("torchvision", 0.08, "pil_bicubic")
  config.augment = recipes.byol_views("torchvision", "multiply", blur=False)
  config.optimizer = recipes.optimizer(
    "larc", base_lr=0.3, weight_decay=1e-6, trust_coefficient=0.02
  )
  if args.runlocal:
    recipes.runlocal(config)
    for mlp in (config.projector, config.predictor):
      mlp.hidden_dims = (512,)
      mlp.out_dim = 128
  if args.model == "vit_tiny":
    mean, std = config.model.input_mean, config.model.input_std
    if args.runlocal:
      config.model = recipes.vit_model("vit_tiny", 8, "float32", random_patch_projection=True)
      config.model.update(width=0.5, depth=4)
      config.optimizer = recipes.optimizer(
        "adamw", base_lr=1e-3, weight_decay=0.1, warmup_epochs=0.5
      )
      config.duration = "800 steps"
      for evaluator in config.evaluators.values():
        evaluator.every = "400 steps"
    else:
      config.model = recipes.vit_model("vit_tiny", 4, "float32", random_patch_projection=True)
      config.optimizer = recipes.optimizer(
        "adamw", base_lr=1.5e-4, weight_decay=0.1, warmup_epochs=40
      )
    config.model.update(input_mean=mean, input_std=std)
    config.predictor.final_bn = True  # MoCo v3's ViT predictor ends in an affine-free BN.
  config.model.dtype = args.dtype
  return config
