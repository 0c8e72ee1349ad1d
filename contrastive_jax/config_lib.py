"""Building blocks of the configs in configs/: shared defaults and augmentation presets."""
import ml_collections
from ml_collections import config_dict


def simclr_view(strength: float, blur_prob: float) -> dict:
  """SimCLR's on-device view settings (Appendix A): jitter strength s, grayscale 0.2."""
  return dict(brightness=0.8 * strength, contrast=0.8 * strength, saturation=0.8 * strength,
              hue=0.2 * strength, color_jitter_prob=0.8, grayscale_prob=0.2,
              blur_prob=blur_prob)


def base_config() -> ml_collections.ConfigDict:
  """Defaults for data, logging, checkpoints and the kNN monitor."""
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.dataset = "cifar10"
  config.data_dir = config_dict.placeholder(str)  # None: TFDS_DATA_DIR or ~/tensorflow_datasets.
  config.train_split = "train"
  config.eval_split = "test"
  config.image_size = 32
  config.crop_area_min = 0.08
  config.eval_crop_fraction = 1.0
  config.cache = True  # Keep decoded images in host memory (small datasets only).
  config.shuffle_buffer = 50_000
  config.data_threads = 2
  config.num_epochs = 100
  config.total_steps = -1  # > 0 overrides num_epochs.
  config.log_every_steps = 100
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 3
  # The kNN monitor's bank is bank_split (default: the whole train split),
  # its queries the whole eval_split.
  config.knn = dict(every_steps=5000, k=200, temperature=0.1, batch_size=1000,
                    bank_split="train")
  return config


def moco_v1_view() -> dict:
  """MoCo v1's views (He et al. 2019, Sec. 4.1): jitter 0.4 on all four, always; grayscale 0.2."""
  return dict(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.4, color_jitter_prob=1.0,
              grayscale_prob=0.2)


def moco_v2_view(blur_prob: float) -> dict:
  """MoCo v2's views (Chen et al. 2020b): jitter (0.4, 0.4, 0.4, 0.1) p 0.8, grayscale 0.2, blur."""
  return dict(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1, color_jitter_prob=0.8,
              grayscale_prob=0.2, blur_prob=blur_prob)


def byol_views() -> dict:
  """BYOL's asymmetric views (Grill et al. 2020, Table 6): view 1 always blurred, never
  solarized; view 2 blurred with p 0.1 and solarized with p 0.2."""
  jitter = dict(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1, color_jitter_prob=0.8,
                grayscale_prob=0.2)
  return dict(view1=dict(jitter, blur_prob=1.0, solarize_prob=0.0),
              view2=dict(jitter, blur_prob=0.1, solarize_prob=0.2))


def runlocal(config, *, knn_every_steps: int = 500):
  """Shrinks a CIFAR-10 config to 8-12 minutes on a 2-core CPU, same code path.

  Narrow ResNet-18 (width 0.25: 16 to 128 channels) with the ImageNet stem,
  whose stride 4 makes the step ~8x cheaper on 32x32 images than the CIFAR
  stem (the difference between ~3 and ~8 epochs in the time); batch 256,
  1500 steps (~7.7 epochs), kNN every 500 steps.
  """
  config.batch_size = 256
  config.total_steps = 1500
  config.model.width = 0.25
  config.model.stem = "imagenet"
  config.optimizer.warmup_epochs = 1
  config.log_every_steps = 20
  config.checkpoint_every_steps = 200
  config.knn.every_steps = knn_every_steps
  return config


def optimizer(name: str, base_lr: float, weight_decay: float, **overrides) -> dict:
  """An optimizer config: warm-up then cosine by default, linear lr scaling.

  schedule 'step' multiplies the lr by decay_factor at each of decay_epochs.
  """
  config = dict(name=name, base_lr=base_lr, lr_scaling="linear", weight_decay=weight_decay,
                momentum=0.9, trust_coefficient=0.001, warmup_epochs=10, schedule="cosine",
                decay_epochs=(), decay_factor=0.1)
  config.update(overrides)
  return config


def imagenet(config, *, batch_size: int, num_epochs: int):
  """Sets ImageNet (TFDS imagenet2012, 224 px) data fields and a ResNet-50 in bfloat16.

  The kNN bank is 10% of train (128k x 2048 floats, 1 GB on the host),
  evaluated every 10 epochs.
  """
  config.dataset = "imagenet2012"
  config.eval_split = "validation"
  config.image_size = 224
  config.eval_crop_fraction = 0.875
  config.cache = False
  config.data_threads = 32
  config.batch_size = batch_size
  config.num_epochs = num_epochs
  config.model = dict(name="resnet50", width=1.0, stem="imagenet", dtype="bfloat16")
  config.checkpoint_every_steps = 2000
  config.knn.bank_split = "train[:10%]"
  config.knn.every_steps = 10 * (1_281_167 // batch_size)
  config.knn.batch_size = 1024
  return config
