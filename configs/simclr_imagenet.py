"""SimCLR on ImageNet (Chen et al. 2020, arXiv 2002.05709; google-research/simclr).

Arguments (--config=configs/simclr_imagenet.py:ARG,ARG..., e.g. :epochs=1000), named by
what they reproduce (top-1 of a linear classifier on the frozen ResNet-50, the
`simclr` probe preset's protocol with ImageNet's figures: batch 4096, 90 epochs,
weight decay 1e-6):
  `epochs=100` (the default; variant `100ep`): about 64.5%, the reference README's
      figure for its 100-epoch pretraining command, which this config is (6 h on 32
      TPU v3 cores there);
  `epochs=1000` (variant `1000ep`): 69.3%, the paper's ResNet-50 (1x) result (Table
      6), the same recipe trained for 1000 epochs;
  `dtype=bfloat16` (the default) or `dtype=float32`: the encoder's compute dtype.
Recipe (README command and the code's defaults; Appendix B.1): batch 4096,
LARS lr 0.3 x B/256 = 4.8 (equal to the 0.075 x sqrt(B) rule at this batch)
applied inside the momentum, weight decay 1e-6 with biases and BN excluded,
10 warm-up epochs then cosine, temperature 0.1, a 2-layer projection head
(2048, then 128 with no bias and a BN without offset), global BN, TF's
variance-scaling initialisation, zero-initialised last BN scale of each block,
inputs in [0, 1], TensorFlow's distorted-bounding-box crop (area 0.08-1,
bicubic), color jitter strength 1.0 with tf.image ops and v1's additive
brightness, blur p 0.5 (kernel 10% of the side, zero-padded), bfloat16.

The recipes and their sources: docs/recipes.md; the runs measured: docs/results.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(epochs=(100, 1000), dtype=("bfloat16", "float32"))
VARIANTS = {"100ep": "epochs=100", "1000ep": "epochs=1000"}


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS, VARIANTS)
  config = recipes.imagenet(
    recipes.base_config(), batch_size=4096, num_epochs=args.epochs, reference="simclr"
  )
  config.method = "simclr"
  config.projector = dict(
    hidden_dims=(2048,), out_dim=128, use_bn=True, final_bn=True, init="normal_0.01"
  )
  config.temperature = 0.1
  config.crop = recipes.crop("tensorflow", 0.08, "tf_bicubic")
  config.augment = dict(view1=recipes.simclr_view(1.0, 0.5), view2=recipes.simclr_view(1.0, 0.5))
  config.optimizer = recipes.optimizer(
    "lars", base_lr=0.3, weight_decay=1e-6, lr_before_momentum=True
  )
  config.model.dtype = args.dtype
  return config
