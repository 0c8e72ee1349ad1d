"""SimCLR on CIFAR-10: the reference README's CIFAR-10 recipe (google-research/simclr).

Targets about 91% top-1 with the README's linear evaluation (the `simclr`
probe preset) after 1000 epochs; ResNet-50 gives about 94% (Chen et al. 2020,
Appendix B.9). The README's command:
  run.py --train_mode=pretrain --train_batch_size=512 --train_epochs=1000
      --learning_rate=1.0 --weight_decay=1e-6 --temperature=0.5 --dataset=cifar10
      --image_size=32 --resnet_depth=18 --use_blur=False --color_jitter_strength=0.5
with the code's defaults for the rest: LARS (trust coefficient 0.001, momentum
0.9, biases and BN excluded, lr 1.0 x B/256 applied inside the momentum),
10 warm-up epochs then cosine, a 2-layer projection head (512, then 128 with
no bias and a BN without offset), global BN, ResNet-18 with the 3x3 stride-1
stem and no max-pool, TF's variance-scaling initialisation and zero-initialised
last BN scale of each block, TensorFlow's distorted-bounding-box crop (area
0.08-1, bicubic) and tf.image color ops with v1's additive brightness (see
recipes.simclr_view for the v2 switch).

Arguments (--config=configs/simclr_cifar10.py:ARG,ARG..., e.g. :runlocal,dtype=bfloat16):
  `runlocal`: the same job shrunk for a 2-core CPU (recipes.runlocal: narrow
      ResNet-18, batch 256, 1500 steps);
  `dtype=float32` (the default) or `dtype=bfloat16`: the encoder's compute dtype.

The recipes and their sources: docs/recipes.md; the runs measured: docs/results.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(runlocal=False, dtype=("float32", "bfloat16"))


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS)
  config = recipes.base_config()
  config.method = "simclr"
  config.batch_size = 512
  config.duration = "1000 epochs"
  config.model = recipes.model("resnet18", "cifar", "float32", "simclr")
  config.projector = dict(
    hidden_dims=(512,), out_dim=128, use_bn=True, final_bn=True, init="normal_0.01"
  )
  config.temperature = 0.5
  config.crop = recipes.crop("tensorflow", 0.08, "tf_bicubic")
  config.augment = dict(view1=recipes.simclr_view(0.5, 0.0), view2=recipes.simclr_view(0.5, 0.0))
  config.optimizer = recipes.optimizer(
    "lars", base_lr=1.0, weight_decay=1e-6, lr_before_momentum=True
  )
  if args.runlocal:
    recipes.runlocal(config)
    config.projector.hidden_dims = (128,)
  config.model.dtype = args.dtype
  return config
