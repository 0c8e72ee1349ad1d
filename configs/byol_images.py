"""BYOL on an image folder prepared by the prepare job (Grill et al. 2020).

  python -m contrastive_jax.main --config=configs/byol_images.py \\
      --config.dataset=NAME --config.data_dir=DIR --workdir=RUN

ResNet-18 (ImageNet stem) at 224 px (--config.image_size=64 to 224), batch
256, 200 epochs, LARS lr 0.2 x B/256, weight decay 1.5e-6, 10 warm-up epochs
then cosine, target EMA tau_base 0.99 (the paper's value for short
schedules), projector and predictor Linear 4096, BN, ReLU, Linear 256,
asymmetric augmentations (Table 6). kNN monitor (k 20) and online probe on
the test split; an unlabeled folder needs --config.evaluators='{}'.

Arguments (--config=configs/byol_images.py:ARG,ARG...):
  `runlocal`: 64 px, ResNet-18 at width 0.25, batch 128, 400 steps,
      narrower heads, a larger lr for the short schedule; sized for about 10
      minutes on a 2-core CPU (recipes.runlocal_images);
  `dtype=float32` (the default) or `dtype=bfloat16`: the encoder's compute dtype.

Preparing a folder and its configs: docs/images.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(runlocal=False, dtype=("float32", "bfloat16"))


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS)
  config = recipes.images(recipes.base_config(), batch_size=256, num_epochs=200, reference="byol")
  config.method = "byol"
  config.projector = dict(hidden_dims=(4096,), out_dim=256, use_bn=True, init="lecun_normal")
  config.predictor = dict(hidden_dims=(4096,), out_dim=256, use_bn=True, init="lecun_normal")
  config.byol = dict(tau_base=0.99)
  config.crop = recipes.crop("byol", 0.08, "tf_bicubic")
  config.augment = recipes.byol_views()
  config.optimizer = recipes.optimizer("lars", base_lr=0.2, weight_decay=1.5e-6)
  if args.runlocal:
    recipes.runlocal_images(config, steps=400)
    config.projector.hidden_dims = (512,)
    config.projector.out_dim = 128
    config.predictor.hidden_dims = (512,)
    config.predictor.out_dim = 128
    config.optimizer.base_lr = 1.0
  config.model.dtype = args.dtype
  return config
