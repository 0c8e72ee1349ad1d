"""MoCo v2 on ImageNet (Chen et al. 2020b, arXiv 2003.04297).

MoCo v1's recipe plus an MLP head (2048-d hidden, ReLU), t 0.2, Gaussian blur
p 0.5, jitter (0.4, 0.4, 0.4, 0.1) p 0.8, cosine lr: ResNet-50, batch 256, SGD
lr 0.03, weight decay 1e-4, 200 epochs, queue 65536, momentum 0.999.
Linear probe: 67.5% top-1 at 200 epochs, 71.1% at 800. 200 epochs took 53 h
on 8 V100.
"""
from contrastive_jax import config_lib


def get_config(variant: str = ""):
  config = config_lib.imagenet(config_lib.base_config(), batch_size=256, num_epochs=200)
  config.method = "moco"
  config.crop_area_min = 0.2
  config.projector = dict(hidden_dims=(2048,), out_dim=128, use_bn=False)
  config.temperature = 0.2
  config.moco = dict(queue_size=65536, momentum=0.999, momentum_schedule="constant",
                     bn_groups=8)
  config.augment = dict(view1=config_lib.moco_v2_view(0.5), view2=config_lib.moco_v2_view(0.5))
  config.optimizer = config_lib.optimizer("sgd", base_lr=0.03, weight_decay=1e-4,
                                          warmup_epochs=0)
  if variant:
    raise ValueError(f"Unknown variant {variant!r} of moco_v2_imagenet; it has none.")
  return config
