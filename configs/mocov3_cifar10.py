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

Variant `runlocal`: the same job shrunk for a 2-core CPU (recipes.runlocal:
ResNet-18 at width 0.25 with the ImageNet stem, batch 256, 1500 steps), with
narrower heads (512 hidden, 128 out). A step costs about a BYOL runlocal step
(four forward passes, two backward).

Variant `runlocal_vit`: a ViT-Tiny (vit_tiny's 3 heads) shrunk so that a step is
cheap on 2 CPU cores: D 96 (width 0.5), 4 blocks, patch 8 on the 32 px images
(16 patches and the class token: attention over 17 tokens; patch 4 would make
65 tokens and a step about 4x dearer), batch 256, 800 steps (a step costs 1.3
CPU-seconds here, about twice the ResNet's), evaluators every 400, the same heads
as `runlocal` but for the predictor's last BN without affine parameters (MoCo v3's
MoCo_ViT, builder.py); MoCo v3's ViT optimisation (AdamW, weight decay 0.1 on kernels,
random frozen patch projection, t 0.2) with a base learning rate of 1e-3 x
B/256, 6.7x MoCo v3's 1.5e-4 (at batch 256 the step is still below the 2.4e-3
of its batch-4096 runs), and a warm-up of half an epoch (98 steps) instead of
40 epochs: a ViT learns slowly from few images and few steps, and 1500 steps
leave no room for a long warm-up.
"""
from contrastive_jax import recipes

VARIANTS = ("runlocal", "runlocal_vit")


def get_config(variant: str = ""):
  recipes.check_variant(variant, VARIANTS)
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
  recipes.crop(config, "torchvision", 0.08, "pil_bicubic")
  config.augment = recipes.byol_views("torchvision", "multiply", blur=False)
  config.optimizer = recipes.optimizer("larc", base_lr=0.3, weight_decay=1e-6,
                                       trust_coefficient=0.02)
  if variant in ("runlocal", "runlocal_vit"):
    recipes.runlocal(config)
    for mlp in (config.projector, config.predictor):
      mlp.hidden_dims = (512,)
      mlp.out_dim = 128
  if variant == "runlocal_vit":
    mean, std = config.model.input_mean, config.model.input_std
    config.model = recipes.vit_model("vit_tiny", 8, "float32", random_patch_projection=True)
    config.model.update(width=0.5, depth=4, input_mean=mean, input_std=std)
    config.optimizer = recipes.optimizer("adamw", base_lr=1e-3, weight_decay=0.1,
                                         warmup_epochs=0.5)
    config.predictor.final_bn = True  # MoCo v3's ViT predictor ends in an affine-free BN.
    config.duration = "800 steps"
    for evaluator in config.evaluators.values():
      evaluator.every = "400 steps"
  return config
