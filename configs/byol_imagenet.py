"""BYOL on ImageNet (Grill et al. 2020, arXiv 2006.07733; deepmind-research byol/).

Arguments (--config=configs/byol_imagenet.py:ARG,ARG..., e.g. :epochs=300), named by
what they reproduce (top-1 of BYOL's linear evaluation, the `byol` probe preset, on
the frozen ResNet-50), with the reference's presets for each length
(byol/configs/byol.py):
  `epochs=1000` (the default; variant `1000ep`): 74.3% (the paper's Table 1; the
      reference README: 74.0 to 74.5 with this code, 8 h on 512 TPU v3 cores); lr
      0.2 x B/256, weight decay 1.5e-6, tau_base 0.996;
  `epochs=300` (variant `300ep`): 72.5%, the paper's 300-epoch baseline of its
      ablations (Sec. 5); lr 0.3 x B/256, weight decay 1e-6, tau_base 0.99;
  `dtype=bfloat16` (the default) or `dtype=float32`: the encoder's compute dtype.
Recipe: batch 4096, BYOL's LARS (trust coefficient 0.001, momentum 0.9 on the
unscaled steps, biases and BN excluded), 10 warm-up epochs then cosine,
target EMA ramped to 1 (cosine), projector and predictor Linear 4096, BN,
ReLU, Linear 256 (Haiku's initialisation), global BN, each view its own
forward pass, the target network initialised with its own key, Haiku's
variance-scaling conv initialisation and the code's zero-initialised last BN
scale of each block (the paper's runs used 1; the README reports no change
for ResNet-50 1x), ImageNet standardisation, BYOL's own crop (area 0.08-1,
bicubic), tf.image color ops with additive brightness, asymmetric blur and
solarization (recipes.byol_views); bfloat16.

The recipes and their sources: docs/recipes.md; the runs measured: docs/results.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

# epochs -> (base lr, weight decay, tau_base): byol/configs/byol.py's presets.
PRESETS = {300: (0.3, 1e-6, 0.99), 1000: (0.2, 1.5e-6, 0.996)}
ARGS = dict(epochs=(1000, 300), dtype=("bfloat16", "float32"))
VARIANTS = {"300ep": "epochs=300", "1000ep": "epochs=1000"}


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS, VARIANTS)
  base_lr, weight_decay, tau_base = PRESETS[args.epochs]
  config = recipes.imagenet(
    recipes.base_config(), batch_size=4096, num_epochs=args.epochs, reference="byol"
  )
  config.method = "byol"
  config.projector = dict(hidden_dims=(4096,), out_dim=256, use_bn=True, init="lecun_normal")
  config.predictor = dict(hidden_dims=(4096,), out_dim=256, use_bn=True, init="lecun_normal")
  config.byol = dict(tau_base=tau_base)
  config.crop = recipes.crop("byol", 0.08, "tf_bicubic")
  config.augment = recipes.byol_views()
  config.optimizer = recipes.optimizer("lars", base_lr=base_lr, weight_decay=weight_decay)
  config.model.dtype = args.dtype
  return config
