"""SimCLR on ImageNet (Chen et al. 2020, Sec. 2.3 and Appendix B).

ResNet-50, global batch 4096, 100 epochs, LARS lr 0.3 x B/256 (4.8), weight
decay 1e-6, 10 warm-up epochs then cosine, temperature 0.1, blur p 0.5,
color jitter strength 1.0, 2-layer 2048-d projection head to 128-d, bfloat16
compute. Needs a TPU pod (100 epochs took about 6 h on 32 TPU v3 cores) and a
prepared `imagenet2012` in data_dir. Linear probe: 69.3% top-1 at 1000 epochs.
"""
from contrastive_jax import config_lib


def get_config(variant: str = ""):
  config = config_lib.imagenet(config_lib.base_config(), batch_size=4096, num_epochs=100)
  config.method = "simclr"
  config.projector = dict(hidden_dims=(2048,), out_dim=128, use_bn=True)
  config.temperature = 0.1
  config.augment = dict(view1=config_lib.simclr_view(1.0, 0.5),
                        view2=config_lib.simclr_view(1.0, 0.5))
  config.optimizer = config_lib.optimizer("lars", base_lr=0.3, weight_decay=1e-6)
  if variant:
    raise ValueError(f"Unknown variant {variant!r} of simclr_imagenet; it has none.")
  return config
