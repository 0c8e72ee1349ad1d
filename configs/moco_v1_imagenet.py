"""MoCo v1 on ImageNet (He et al. 2019, Sec. 4.1 and Appendix A.1).

ResNet-50, batch 256 (8 GPUs x 32: BN groups of 32), SGD lr 0.03, momentum
0.9, weight decay 1e-4, 200 epochs with lr x0.1 at 120 and 160, queue 65536,
key momentum 0.999, t 0.07, linear 128-d head, crop (0.2, 1), jitter 0.4,
grayscale 0.2. Linear probe: 60.6% top-1.
"""
from contrastive_jax import config_lib


def get_config(variant: str = ""):
  config = config_lib.imagenet(config_lib.base_config(), batch_size=256, num_epochs=200)
  config.method = "moco"
  config.crop_area_min = 0.2
  config.projector = dict(hidden_dims=(), out_dim=128, use_bn=False)
  config.temperature = 0.07
  config.moco = dict(queue_size=65536, momentum=0.999, momentum_schedule="constant",
                     bn_groups=8)
  config.augment = dict(view1=config_lib.moco_v1_view(), view2=config_lib.moco_v1_view())
  config.optimizer = config_lib.optimizer("sgd", base_lr=0.03, weight_decay=1e-4,
                                          warmup_epochs=0, schedule="step",
                                          decay_epochs=(120, 160))
  if variant:
    raise ValueError(f"Unknown variant {variant!r} of moco_v1_imagenet; it has none.")
  return config
