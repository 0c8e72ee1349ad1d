"""SimCLR on CIFAR-10 (Chen et al. 2020, Appendix B.9; reference README recipe).

ResNet-18 with the CIFAR stem, batch 512, 1000 epochs, LARS lr 1.0 x B/256,
weight decay 1e-6, 10 warm-up epochs then cosine, temperature 0.5, color
jitter strength 0.5, no blur.

Variants: `configs/simclr_cifar10.py:runlocal` is the same job shrunk for a
2-core CPU (config_lib.runlocal: narrow ResNet-18, batch 256, ~10 minutes).
"""
from contrastive_jax import config_lib


def get_config(variant: str = ""):
  config = config_lib.base_config()
  config.method = "simclr"
  config.batch_size = 512
  config.duration = "1000 epochs"
  config.model = dict(name="resnet18", width=1.0, stem="cifar", dtype="float32")
  config.projector = dict(hidden_dims=(512,), out_dim=128, use_bn=True)
  config.temperature = 0.5
  config.augment = dict(view1=config_lib.simclr_view(0.5, 0.0),
                        view2=config_lib.simclr_view(0.5, 0.0))
  config.optimizer = config_lib.optimizer("lars", base_lr=1.0, weight_decay=1e-6)
  if variant == "runlocal":
    config_lib.runlocal(config)
    config.projector.hidden_dims = (128,)
  elif variant:
    raise ValueError(f"Unknown variant {variant!r} of simclr_cifar10; known: 'runlocal'.")
  return config
