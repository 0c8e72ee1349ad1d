"""MoCo on CIFAR-10: the MoCo authors' CIFAR-10 demo (facebookresearch/moco,
colab/moco_cifar10_demo.ipynb), asymmetric loss.

MoCo published no CIFAR-10 recipe in its papers; the demo is its authors' own,
and targets 82.6% top-1 of a kNN monitor (k 200, t 0.1) at 200 epochs (86.3
at 400, 88.7 at 800), measured there on the normalised 128-d output; this
project's kNN monitor measures h, the 512-d representation before it. The
demo: ResNet-18 with a 3x3 stride-1 stem and no max-pool, torchvision's
initialisation (He-normal convs, last BN scale 1, nn.Linear's default for the
head), the linear 128-d head of MoCo v1 (resnet18(num_classes=128)), queue
4096, key momentum 0.99, temperature 0.1, batch 512, SGD lr 0.06 (0.03 x
B/256), momentum 0.9, weight decay 5e-4 on every parameter, cosine schedule
without warm-up, 200 epochs, SplitBatchNorm with 8 splits (BN groups of 64
images) for shuffle BN, MoCo v2's augmentation without blur:
RandomResizedCrop(32) (scale 0.08-1, bilinear), torchvision's ColorJitter(0.4,
0.4, 0.4, 0.1) p 0.8, grayscale p 0.2, flip; inputs standardised with the
demo's CIFAR-10 mean and std.

Arguments (--config=configs/moco_v2_cifar10.py:ARG,ARG..., e.g. :runlocal,dtype=bfloat16):
  `runlocal`: the same job shrunk for a 2-core CPU (recipes.runlocal), with BN
      groups of 32 to keep 8 groups at batch 256;
  `dtype=float32` (the default) or `dtype=bfloat16`: the encoder's compute dtype.

The recipes and their sources: docs/recipes.md; the runs measured: docs/results.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(runlocal=False, dtype=("float32", "bfloat16"))


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS)
  config = recipes.base_config()
  config.method = "moco"
  config.batch_size = 512
  config.duration = "200 epochs"
  config.model = recipes.model("resnet18", "cifar", "float32", "torchvision")
  config.model.input_mean = (0.4914, 0.4822, 0.4465)
  config.model.input_std = (0.2023, 0.1994, 0.2010)
  config.projector = dict(hidden_dims=(), out_dim=128, use_bn=False, init="torch")
  config.temperature = 0.1
  config.moco = dict(queue_size=4096, momentum=0.99, momentum_schedule="constant", bn_group_size=64)
  config.crop = recipes.crop("torchvision", 0.08, "pil_bilinear")
  config.augment = dict(view1=recipes.moco_v2_view(0.0), view2=recipes.moco_v2_view(0.0))
  config.optimizer = recipes.optimizer(
    "sgd", base_lr=0.03, weight_decay=5e-4, warmup_epochs=0, weight_decay_mask="all"
  )
  if args.runlocal:
    recipes.runlocal(config)
    config.moco.bn_group_size = 32
  config.model.dtype = args.dtype
  return config
