"""BYOL on ImageNet (Grill et al. 2020, Sec. 3.3 and Appendix C).

ResNet-50, batch 4096, 1000 epochs, LARS lr 0.2 x B/256 (3.2), weight decay
1.5e-6, 10 warm-up epochs then cosine, tau_base 0.996, projector and predictor
Linear 4096, BN, ReLU, Linear 256, asymmetric augmentations. Linear probe:
74.3% top-1 (512 TPU v3 cores, about 8 h).
"""
from contrastive_jax import config_lib


def get_config(variant: str = ""):
  config = config_lib.imagenet(config_lib.base_config(), batch_size=4096, num_epochs=1000)
  config.method = "byol"
  config.projector = dict(hidden_dims=(4096,), out_dim=256, use_bn=True)
  config.predictor = dict(hidden_dims=(4096,), out_dim=256, use_bn=True)
  config.byol = dict(tau_base=0.996)
  config.augment = config_lib.byol_views()
  config.optimizer = config_lib.optimizer("lars", base_lr=0.2, weight_decay=1.5e-6)
  if variant:
    raise ValueError(f"Unknown variant {variant!r} of byol_imagenet; it has none.")
  return config
