"""BYOL on CIFAR-10 with the paper's recipe (Grill et al. 2020, Sec. 3.3, App. B-C).

Projector and predictor: Linear 4096, BN, ReLU, Linear 256. LARS lr 0.2 x B/256,
weight decay 1.5e-6 (biases and BN left out), 10 warm-up epochs then cosine,
target EMA tau_base 0.996 ramped to 1 (cosine), asymmetric augmentations.
ResNet-18 with the CIFAR stem, batch 512, 1000 epochs.

Variant `runlocal`: the same job shrunk for a 2-core CPU (config_lib.runlocal),
with narrower heads, tau_base 0.99 (the paper's value for short runs) and a
larger lr for the short schedule.
"""
from contrastive_jax import config_lib


def get_config(variant: str = ""):
  config = config_lib.base_config()
  config.method = "byol"
  config.batch_size = 512
  config.duration = "1000 epochs"
  config.model = dict(name="resnet18", width=1.0, stem="cifar", dtype="float32")
  config.projector = dict(hidden_dims=(4096,), out_dim=256, use_bn=True)
  config.predictor = dict(hidden_dims=(4096,), out_dim=256, use_bn=True)
  config.byol = dict(tau_base=0.996)
  config.augment = config_lib.byol_views()
  config.optimizer = config_lib.optimizer("lars", base_lr=0.2, weight_decay=1.5e-6)
  if variant == "runlocal":
    config_lib.runlocal(config)
    config.projector.hidden_dims = (512,)
    config.projector.out_dim = 128
    config.predictor.hidden_dims = (512,)
    config.predictor.out_dim = 128
    config.byol.tau_base = 0.99
    config.optimizer.base_lr = 1.0
  elif variant:
    raise ValueError(f"Unknown variant {variant!r} of byol_cifar10; known: 'runlocal'.")
  return config
