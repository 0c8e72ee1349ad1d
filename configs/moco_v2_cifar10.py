"""MoCo v2 on CIFAR-10.

MoCo v2's changes over v1 (Chen et al. 2020b): MLP head, t = 0.2, cosine lr,
stronger augmentation (no blur on 32x32 images, as in SimCLR's CIFAR recipe);
CIFAR-10 sizes from the MoCo authors' CIFAR demo: ResNet-18 with the CIFAR
stem, batch 512, SGD lr 0.06 (0.03 x B/256), weight decay 5e-4, 200 epochs,
queue 4096, momentum 0.99, 8 BN groups (the reference's 8 GPUs) for shuffle
BN on 1, 2, 4 or 8 devices (see methods/moco.py).

Variant `runlocal`: the same job shrunk for a 2-core CPU (config_lib.runlocal).
"""
from contrastive_jax import config_lib


def get_config(variant: str = ""):
  config = config_lib.base_config()
  config.method = "moco"
  config.batch_size = 512
  config.duration = "200 epochs"
  config.crop_area_min = 0.2
  config.model = dict(name="resnet18", width=1.0, stem="cifar", dtype="float32")
  config.projector = dict(hidden_dims=(512,), out_dim=128, use_bn=False)
  config.temperature = 0.2
  config.moco = dict(queue_size=4096, momentum=0.99, momentum_schedule="constant",
                     bn_groups=8)
  config.augment = dict(view1=config_lib.moco_v2_view(0.0), view2=config_lib.moco_v2_view(0.0))
  config.optimizer = config_lib.optimizer("sgd", base_lr=0.03, weight_decay=5e-4,
                                          warmup_epochs=0)
  if variant == "runlocal":
    config_lib.runlocal(config)
    config.projector.hidden_dims = (128,)
    config.optimizer.base_lr = 0.06
  elif variant:
    raise ValueError(f"Unknown variant {variant!r} of moco_v2_cifar10; known: 'runlocal'.")
  return config
