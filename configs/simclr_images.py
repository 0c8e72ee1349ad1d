"""SimCLR on an image folder prepared by the prepare job (Chen et al. 2020).

  python -m contrastive_jax.main --config=configs/prepare.py --config.src=PHOTOS \\
      --config.name=NAME --workdir=DIR
  python -m contrastive_jax.main --config=configs/simclr_images.py \\
      --config.dataset=NAME --config.data_dir=DIR --workdir=RUN

ResNet-18 (ImageNet stem) at 224 px (--config.image_size=64 to 224), batch
256, 200 epochs, LARS with square-root lr scaling 0.075 x sqrt(B) (the
paper's choice for small batches, Appendix B.1), weight decay 1e-6, 10
warm-up epochs then cosine, temperature 0.1, jitter strength 1.0 and blur
p 0.5 (Appendix A), 2-layer head to 128-d. kNN monitor (k 20) and online
probe on the test split; an unlabeled folder needs --config.evaluators='{}'.

Arguments (--config=configs/simclr_images.py:ARG,ARG...):
  `runlocal`: 64 px, ResNet-18 at width 0.25, batch 128, 400 steps,
      sized for about 10 minutes on a 2-core CPU (recipes.runlocal_images);
  `dtype=float32` (the default) or `dtype=bfloat16`: the encoder's compute dtype.

Preparing a folder and its configs: docs/images.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(runlocal=False, dtype=("float32", "bfloat16"))


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS)
  config = recipes.images(recipes.base_config(), batch_size=256, num_epochs=200, reference="simclr")
  config.method = "simclr"
  config.projector = dict(
    hidden_dims=(512,), out_dim=128, use_bn=True, final_bn=True, init="normal_0.01"
  )
  config.temperature = 0.1
  config.crop = recipes.crop("tensorflow", 0.08, "tf_bicubic")
  config.augment = dict(view1=recipes.simclr_view(1.0, 0.5), view2=recipes.simclr_view(1.0, 0.5))
  config.optimizer = recipes.optimizer(
    "lars", base_lr=0.075, weight_decay=1e-6, lr_scaling="sqrt", lr_before_momentum=True
  )
  if args.runlocal:
    recipes.runlocal_images(config, steps=400)
    config.projector.hidden_dims = (128,)
  config.model.dtype = args.dtype
  return config
