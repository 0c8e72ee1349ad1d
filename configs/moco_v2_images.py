"""MoCo v2 on an image folder prepared by the prepare job (Chen et al. 2020b).

  python -m contrastive_jax.main --config=configs/moco_v2_images.py \\
      --config.dataset=NAME --config.data_dir=DIR --workdir=RUN

MoCo v2's ImageNet recipe on ResNet-18 (ImageNet stem) at 224 px
(--config.image_size=64 to 224): batch 256, SGD lr 0.03 x B/256, weight decay
1e-4, cosine, 200 epochs, MLP head, t 0.2, blur p 0.5, jitter (0.4, 0.4, 0.4,
0.1) p 0.8; key momentum 0.99 and a queue of 2048 keys instead of 0.999 and
65536: a folder of a few thousand images has fewer steps and must hold more
images than the queue (raise both for large folders). kNN monitor (k 20) and
online probe on the test split; an unlabeled folder needs
--config.evaluators='{}'.

Arguments (--config=configs/moco_v2_images.py:ARG,ARG...):
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
  config = recipes.images(
    recipes.base_config(), batch_size=256, num_epochs=200, reference="torchvision"
  )
  config.method = "moco"
  config.projector = dict(hidden_dims=(512,), out_dim=128, use_bn=False, init="torch")
  config.temperature = 0.2
  config.moco = dict(queue_size=2048, momentum=0.99, momentum_schedule="constant", bn_group_size=32)
  config.crop = recipes.crop("torchvision", 0.2, "pil_bilinear")
  config.augment = dict(view1=recipes.moco_v2_view(0.5), view2=recipes.moco_v2_view(0.5))
  config.optimizer = recipes.optimizer(
    "sgd", base_lr=0.03, weight_decay=1e-4, warmup_epochs=0, weight_decay_mask="all"
  )
  if args.runlocal:
    recipes.runlocal_images(config, steps=400)
    config.projector.hidden_dims = (128,)
    config.optimizer.base_lr = 0.06
    config.moco.bn_group_size = 16  # 8 groups at batch 128, as at full size.
  config.model.dtype = args.dtype
  return config
