"""Building blocks of the configs in configs/: shared defaults and each reference's recipe.

The view, crop, model and optimizer blocks below each reproduce one
reference's recipe; the docstrings name the reference and the code there.
"""

import ml_collections
from ml_collections import config_dict

from contrastive_jax.config_files import FORMAT_VERSION
from contrastive_jax.models import vit


def simclr_view(strength: float, blur_prob: float, brightness_op: str = "add") -> dict:
  """SimCLR's on-device view (Appendix A; data_util.preprocess_for_train, batch_random_blur).

  Color jitter of strength s (brightness, contrast, saturation 0.8 s, hue
  0.2 s) in random order with p 0.8, tf.image ops; grayscale p 0.2 after it;
  blur with p blur_prob, zero-padded. brightness_op 'add' is v1's
  tf.image.random_brightness (the code behind the v1 paper and README numbers),
  'multiply' the tf2 code's (SimCLR v2).
  """
  return dict(
    brightness=0.8 * strength,
    contrast=0.8 * strength,
    saturation=0.8 * strength,
    hue=0.2 * strength,
    color_jitter_prob=0.8,
    grayscale_prob=0.2,
    blur_prob=blur_prob,
    color_ops="tensorflow",
    brightness_op=brightness_op,
    blur_padding="zeros",
  )


def data_fields(config):
  """Sets the fields every job reads its data with (CIFAR-10 from TFDS by default)."""
  config.seed = 0
  config.data_source = "tfds"
  config.dataset = "cifar10"
  config.data_dir = config_dict.placeholder(str)  # None: TFDS_DATA_DIR or ~/tensorflow_datasets.
  config.train_split = "train"
  # Keep decoded images in host memory (small datasets only), and shuffle
  # through a buffer of shuffle_buffer images: for training, TFRecord datasets
  # only (streamed in file order); ArrayRecord ones are read by index in a
  # full permutation every epoch (input_pipeline.py). Evaluation caches either.
  config.cache = True
  config.shuffle_buffer = 50_000
  config.data_threads = 2
  return config


def pretrained_encoder_fields(config):
  """Sets the fields that say which encoder a downstream job starts from (jobs/downstream.py)."""
  # The pretraining job's --workdir (or the fine-tuning job's: its fine-tuned encoder), or a
  # weights file (.safetensors; .pth with torch) of a torchvision ResNet or timm / MoCo v3
  # ViT, whose model pretrain_config then describes.
  config.pretrain_workdir = config_dict.placeholder(str)
  config.pretrain_config = config_dict.placeholder(str)  # configs/X.py[:ARG,...], for a file.
  config.pretrain_step = -1  # -1: the latest checkpoint.
  config.random_init = False  # True: the pretraining run's encoder at initialisation (baseline).
  config.model_name = config_dict.placeholder(str)  # If set, the checkpoint's model must match.
  return config


def base_config() -> ml_collections.ConfigDict:
  """Pretraining defaults: data, durations, checkpoints and the evaluators.

  Durations ('duration', 'log_every', 'checkpoint_every', each evaluator's
  'every') are strings 'N steps' or 'N epochs', resolved when the job knows
  its dataset size and global batch (to_steps).
  """
  config = data_fields(ml_collections.ConfigDict())
  config.job = "pretrain"
  config.format_version = FORMAT_VERSION
  config.image_size = 32
  config.eval_crop_fraction = 1.0
  config.duration = "100 epochs"
  config.log_every = "100 steps"
  config.checkpoint_every = "1000 steps"
  config.keep_checkpoints = 3
  # Each evaluator also runs at the last step; the kNN monitor at step 0 too.
  config.evaluators = dict(
    knn=dict(
      kind="knn",
      every="10 epochs",
      split="test",
      bank_split="train",
      k=200,
      temperature=0.1,
      batch_size=1000,
    ),
    online_probe=dict(kind="classifier", every="10 epochs", split="test", batch_size=1000),
  )
  config.online_probe = dict(learning_rate=1e-3)
  # Hold the train split in device memory and crop and flip on the device
  # (data/device_data.py): for small datasets of equal-size images (CIFAR). The
  # evaluators still read through the host pipeline.
  config.on_device_data = False
  # A weights file (.safetensors; .pth with torch) of a torchvision ResNet or a timm /
  # MoCo v3 ViT that every network starts from (jobs/pretrain.py, docs/weights.md).
  config.init_from = config_dict.placeholder(str)
  # The config (configs/X.py[:ARG], e.g. configs/dinov2.py:MODEL) whose model init_from holds:
  # the run's model becomes its (jobs/pretrain.py with_init_model). Unset: config.model.
  config.init_config = config_dict.placeholder(str)
  return config


def moco_v1_view() -> dict:
  """MoCo v1's views (main_moco.py without --aug-plus): grayscale p 0.2, then
  torchvision's ColorJitter(0.4, 0.4, 0.4, 0.4) always."""
  return dict(
    brightness=0.4,
    contrast=0.4,
    saturation=0.4,
    hue=0.4,
    color_jitter_prob=1.0,
    grayscale_prob=0.2,
    grayscale_first=True,
    color_ops="torchvision",
    brightness_op="multiply",
  )


def moco_v2_view(blur_prob: float) -> dict:
  """MoCo v2's views (main_moco.py --aug-plus): torchvision's ColorJitter(0.4, 0.4, 0.4,
  0.1) p 0.8, grayscale p 0.2, PIL Gaussian blur (edges repeated) with p blur_prob."""
  return dict(
    brightness=0.4,
    contrast=0.4,
    saturation=0.4,
    hue=0.1,
    color_jitter_prob=0.8,
    grayscale_prob=0.2,
    blur_prob=blur_prob,
    color_ops="torchvision",
    brightness_op="multiply",
    blur_padding="edge",
  )


def byol_views(
  color_ops: str = "tensorflow", brightness_op: str = "add", blur: bool = True
) -> dict:
  """BYOL's asymmetric views (Grill et al. 2020, Table 6; byol/utils/augmentations.py).

  Jitter (0.4, 0.4, 0.2, 0.1) p 0.8 and grayscale p 0.2 on both; view 1
  blurred with p 1.0, never solarized; view 2 blurred with p 0.1 and
  solarized with p 0.2. BYOL's own ops are tf.image's with additive
  brightness and zero-padded blur; solo-learn's CIFAR-10 recipe
  (augmentations/asymmetric.yaml) uses torchvision's ColorJitter and no blur
  (blur=False).
  """
  jitter = dict(
    brightness=0.4,
    contrast=0.4,
    saturation=0.2,
    hue=0.1,
    color_jitter_prob=0.8,
    grayscale_prob=0.2,
    color_ops=color_ops,
    brightness_op=brightness_op,
    blur_padding="zeros",
  )
  return dict(
    view1=dict(jitter, blur_prob=1.0 if blur else 0.0, solarize_prob=0.0),
    view2=dict(jitter, blur_prob=0.1 if blur else 0.0, solarize_prob=0.2),
  )


def mocov3_views() -> dict:
  """MoCo v3's views (moco-v3 main_moco.py, "BYOL's augmentation recipe"):
  BYOL's asymmetric jitter, grayscale, blur (p 1.0 / 0.1) and solarization (p 0 / 0.2),
  with torchvision's ColorJitter and PIL's Gaussian blur (edges repeated)."""
  views = byol_views("torchvision", "multiply")
  for view in views.values():
    view["blur_padding"] = "edge"
  return views


def dino(**overrides) -> dict:
  """config.dino at main_dino.py's argparse defaults (facebookresearch/dino), overrides applied:
  head of 65536 outputs (hidden 2048, bottleneck 256, 3 layers, no BN, weight-normalised last
  layer), teacher momentum 0.996 -> 1, student temperature 0.1, teacher temperature 0.04
  without warm-up, centre momentum 0.9, stochastic depth 0.1 in a ViT student."""
  return dict(
    dict(
      out_dim=65536,
      hidden_dim=2048,
      bottleneck_dim=256,
      num_layers=3,
      use_bn_in_head=False,
      norm_last_layer=True,
      momentum_teacher=0.996,
      student_temp=0.1,
      warmup_teacher_temp=0.04,
      teacher_temp=0.04,
      warmup_teacher_temp_epochs=0,
      center_momentum=0.9,
      drop_path_rate=0.1,
    ),
    **overrides,
  )


def distillation_views() -> dict:
  """LightlyTrain's distillation view (distillation*_transform.py, the same in v1, v2 and
  v3), on both of config.augment's views (the method reads view 1 only): ColorJitter
  strength 0.5 of (0.8, 0.8, 0.4, 0.2), i.e. (0.4, 0.4, 0.2, 0.1), with p 0.8
  (albumentations' ColorJitter: torchvision's ops in random order), grayscale p 0.2, no
  solarisation. Its GaussianBlur (p 1.0, sigma in (0, 0.1) px) is left out: at sigma 0.1
  a neighbour's weight is below e^-50, the identity to float32."""
  view = dict(
    brightness=0.4,
    contrast=0.4,
    saturation=0.2,
    hue=0.1,
    color_jitter_prob=0.8,
    grayscale_prob=0.2,
    blur_prob=0.0,
    solarize_prob=0.0,
    color_ops="torchvision",
    brightness_op="multiply",
    blur_padding="edge",
  )
  return dict(view1=dict(view), view2=dict(view))


# The reference's learning rates at its reference batch of 1536 images, scaled by
# sqrt(B / 1536) (lr_scale_method 'sqrt'): base_lr x sqrt(B) with base_lr = lr / sqrt(1536).
DISTILLATION_REFERENCE_BATCH = 1536


def distillation(loss: str, teacher_model, **overrides) -> dict:
  """config.distill at LightlyTrain's defaults (DistillationArgs, DistillationV2Args,
  DistillationV3Args), overrides applied: the loss ('v1', 'v2', 'v3'); the teacher, a
  weights file of teacher_model (a model config) or a pretraining or fine-tuning workdir
  (teacher_model None: recorded from it); temperatures 0.07 (v1's temperature, v3's
  temperature_global and temperature_local); v3's loss_local_weight 1.0; v2's
  n_teacher_blocks 2; a queue of 8192 (the reference's 'auto' for a split of 20,000
  images or more). What the run reads of the teacher is recorded in teacher_sha256 /
  teacher_step / teacher_paths (methods/distillation.py)."""
  return dict(
    dict(
      loss=loss,
      teacher="",
      teacher_model=teacher_model,
      teacher_sha256="",
      teacher_step=-1,
      teacher_paths=[],
      queue_size=8192,
      temperature=0.07,
      temperature_local=0.07,
      local_weight=1.0,
      teacher_blocks=2,
    ),
    **overrides,
  )


def distillation_optimizer(loss: str, student_is_vit: bool, num_epochs: float) -> dict:
  """LightlyTrain's optimiser for a distillation loss: v1 LARS at lr 1.8 (DistillationLARSArgs),
  v2 LARS at 9.0 (DistillationV2LARSArgs), both momentum 0.9, weight decay 1e-6, trust
  coefficient 0.001; v3 AdamW at 5e-4 (DistillationV3AdamWArgs: its 'auto' optimiser),
  weight decay 0.04 for a transformer student and 1e-6 for a convolutional one (its
  'auto'); each lr at batch 1536, scaled by sqrt(B / 1536). No decay on biases and norms
  (kernels). Warm-up over min(10, epochs / 10) epochs, then cosine to 0
  (Method.configure_optimizers, CosineWarmupScheduler); gradients clipped at global norm
  1.0 (configure_gradient_clipping)."""
  lr = {"v1": 1.8, "v2": 9.0, "v3": 5e-4}[loss]
  if loss == "v3":
    name, weight_decay = "adamw", 0.04 if student_is_vit else 1e-6
  else:
    name, weight_decay = "lars", 1e-6
  return optimizer(
    name,
    base_lr=lr / DISTILLATION_REFERENCE_BATCH**0.5,
    weight_decay=weight_decay,
    lr_scaling="sqrt",
    warmup_epochs=min(10.0, num_epochs / 10),
    clip_global_norm=1.0,
  )


def dino_optimizer(name: str, base_lr: float, weight_decay: float, weight_decay_end) -> dict:
  """DINO's optimizer (main_dino.py): `name` ('adamw' or 'sgd', momentum 0.9) at base_lr x
  B/256 after 10 linear warm-up epochs, cosine to --min_lr 1e-6; weight decay from
  weight_decay to weight_decay_end by a cosine (None: constant), on kernels only
  (get_params_groups: none on biases and norms); each gradient tensor clipped at norm
  --clip_grad 3.0; the last layer held for --freeze_last_layer 1 epoch."""
  return optimizer(
    name,
    base_lr=base_lr,
    weight_decay=weight_decay,
    weight_decay_end=weight_decay_end,
    final_lr=1e-6,
    clip_per_tensor=3.0,
    freeze_last_layer_epochs=1.0,
  )


def dino_multi_crop(config, *, number: int, size: int, global_scale: float, local_scale):
  """Multi-crop as DINO's DataAugmentationDINO: the global views' crop area from global_scale
  to 1, `number` local views of `size` pixels at area local_scale = (min, max), each as
  the global views' view 1 (flip, jitter, grayscale) but blurred with p 0.5 and never
  solarised. Sets config.crop.area_min, config.local_crops and config.augment.local."""
  config.crop.area_min = global_scale
  config.local_crops = dict(
    number=number, size=size, area_min=local_scale[0], area_max=local_scale[1]
  )
  config.augment.local = dict(config.augment.view1, blur_prob=0.5)
  return config


def crop(sampler: str, area_min: float, resize: str) -> dict:
  """config.crop, the training views' random resized crop (crop_spec.CropSpec): a crop_spec.SAMPLERS
  sampler, the smallest crop area as a fraction of the image, a crop_spec.RESIZES resize (the
  evaluation's centre crop resizes with it too)."""
  return dict(sampler=sampler, area_min=area_min, resize=resize)


# ImageNet channel statistics (torchvision's Normalize in MoCo; BYOL's normalize_images).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def model(name: str, stem: str, dtype: str, reference: str) -> dict:
  """A model config with the reference's initialisation and input scaling.

  reference 'simclr': variance-scaling (TF) convs, zero-initialised last BN
  scale of each block, inputs in [0, 1], SimCLR's TF padding and a projection
  shortcut in every stage's first block; 'byol': the same (Haiku's defaults,
  BYOL's zero-init and projections) with ImageNet standardisation and Haiku's
  'SAME' padding; 'torchvision': He-normal fan-out convs, last BN scale 1,
  ImageNet standardisation, torchvision's symmetric padding and shortcuts
  projected only where the shape changes (MoCo).
  (resnet.PADDINGS says where each pads.) CIFAR-10 recipes replace
  input_mean/input_std with their own statistics.
  """
  imagenet = dict(input_mean=IMAGENET_MEAN, input_std=IMAGENET_STD)
  fields = {
    "simclr": dict(
      zero_init_residual=True,
      conv_init="variance_scaling",
      padding="tensorflow",
      stage_projection=True,
      input_mean=(0.0, 0.0, 0.0),
      input_std=(1.0, 1.0, 1.0),
    ),
    "byol": dict(
      zero_init_residual=True,
      conv_init="variance_scaling",
      padding="same",
      stage_projection=True,
      **imagenet,
    ),
    "torchvision": dict(
      zero_init_residual=False,
      conv_init="he_normal",
      padding="torchvision",
      stage_projection=False,
      **imagenet,
    ),
  }
  return dict(name=name, width=1.0, stem=stem, dtype=dtype, **fields[reference])


def vit_model(name: str, patch_size: int, dtype: str, random_patch_projection: bool) -> dict:
  """A ViT model config (a vit.SPECS name) at the spec's width (multiplier
  1) and depth, ImageNet standardisation as MoCo v3's inputs."""
  return dict(
    name=name,
    width=1.0,
    depth=vit.SPECS[name][1],
    patch_size=patch_size,
    dtype=dtype,
    random_patch_projection=random_patch_projection,
    input_mean=IMAGENET_MEAN,
    input_std=IMAGENET_STD,
  )


# DINOv2's published backbones (facebookresearch/dinov2 hubconf.py, backbones.py; timm's
# names): recipe name -> (vit.SPECS size, heads, register tokens, MLP). Patch 14, layer
# scale, a learned position embedding for 518 px (a 37 x 37 grid), interpolated with the
# 0.1 offset without registers and antialiased to the size with them.
DINOV2_MODELS = {
  "vit_small_patch14_dinov2": ("vit_small", 6, 0, "gelu"),
  "vit_small_patch14_reg4_dinov2": ("vit_small", 6, 4, "gelu"),
  "vit_base_patch14_dinov2": ("vit_base", 12, 0, "gelu"),
  "vit_base_patch14_reg4_dinov2": ("vit_base", 12, 4, "gelu"),
  "vit_large_patch14_dinov2": ("vit_large", 16, 0, "gelu"),
  "vit_large_patch14_reg4_dinov2": ("vit_large", 16, 4, "gelu"),
  "vit_giant_patch14_dinov2": ("vit_giant", 24, 0, "swiglu"),
  "vit_giant_patch14_reg4_dinov2": ("vit_giant", 24, 4, "swiglu"),
}


def dinov2_model(name: str, dtype: str) -> dict:
  """The model config of a DINOv2 backbone (a DINOV2_MODELS name): vit_model's fields and
  DINOv2's heads, position embedding (trained grid 37), interpolation, layer scale,
  registers and MLP; inputs ImageNet-standardised as DINOv2's transforms."""
  size, heads, registers, mlp = DINOV2_MODELS[name]
  return dict(
    vit_model(size, 14, dtype, False),
    num_heads=heads,
    position_embedding="learned",
    position_grid=37,
    position_interpolation="antialias" if registers else "offset",
    layer_scale=True,
    registers=registers,
    mlp=mlp,
  )


# DINOv3's published ViTs (facebookresearch/dinov3 hub/backbones.py dinov3_vits16 / vitb16
# / vitl16; timm's names): recipe name -> (vit.SPECS size, heads). Patch 16, RoPE of base 100
# (coordinates normalised separately on each axis), 4 storage tokens, layer scale, the key
# bias masked, LayerNorm eps 1e-5 ('layernormbf16'), GELU MLPs of ratio 4.
DINOV3_MODELS = {
  "vit_small_patch16_dinov3": ("vit_small", 6),
  "vit_base_patch16_dinov3": ("vit_base", 12),
  "vit_large_patch16_dinov3": ("vit_large", 16),
}


def dinov3_model(name: str, dtype: str) -> dict:
  """The model config of a DINOv3 ViT (a DINOV3_MODELS name): vit_model's fields and
  DINOv3's heads, RoPE, storage tokens (the registers field), layer scale, masked key bias
  and LayerNorm eps; inputs ImageNet-standardised as DINOv3's transforms."""
  size, heads = DINOV3_MODELS[name]
  return dict(
    vit_model(size, 16, dtype, False),
    num_heads=heads,
    position_embedding="rope",
    layer_scale=True,
    registers=4,
    mask_key_bias=True,
    norm_epsilon=1e-5,
  )


def foundation_model(name: str, dtype: str) -> dict:
  """The model config of a DINOv2 or DINOv3 backbone: dinov3_model of a DINOV3_MODELS name,
  else dinov2_model (KeyError for a name of neither)."""
  return dinov3_model(name, dtype) if name in DINOV3_MODELS else dinov2_model(name, dtype)


def teacher_models(default: str) -> tuple:
  """The values of a distillation config's `teacher_model` argument, `default` first:
  'checkpoint' (a pretraining or fine-tuning workdir of this package), then every DINOv3
  and DINOv2 backbone name (foundation_model's)."""
  names = ("checkpoint", *DINOV3_MODELS, *DINOV2_MODELS)
  return (default, *(name for name in names if name != default))


def distillation_teacher(name: str):
  """config.distill.teacher_model for a `teacher_model` argument: None for 'checkpoint' (the
  workdir's own model config), else the backbone's model config computing in bfloat16."""
  return None if name == "checkpoint" else foundation_model(name, "bfloat16")


def foundation_backbone(config, model: dict, image_size: int):
  """Makes `config` (base_config's) the pretraining config of a DINOv2 or DINOv3 backbone's
  weights file: DINO's method (so that the probe's `auto` preset is DINO's), ImageNet's
  recipe, the images' side, the references' evaluation crop (dinov2 and dinov3
  data/transforms.py make_classification_eval_transform: shorter side resized to 256
  bicubic, centre crop 224: fraction 0.875), ImageNet standardisation (in `model`)."""
  config.method = "dino"
  imagenet(config, batch_size=64, num_epochs=100, reference="torchvision")
  config.image_size = image_size
  config.eval_crop_fraction = 0.875
  config.crop = crop("torchvision", 0.4, "pil_bicubic")
  config.dino = dino()
  config.model = model
  return config


def runlocal(config):
  """Shrinks a CIFAR-10 config to 4 to 6 minutes on a 2-core CPU (the ResNets of SimCLR, MoCo
  and BYOL, docs/results.md), same code path.

  Narrow ResNet-18 (width 0.25: 16 to 128 channels) with the ImageNet stem,
  whose stride 4 makes the step ~8x cheaper on 32x32 images than the CIFAR
  stem (the difference between ~3 and ~8 epochs in the time); batch 256,
  1500 steps (~7.7 epochs), evaluators every 500 steps.
  """
  config.batch_size = 256
  config.duration = "1500 steps"
  config.model.width = 0.25
  config.model.stem = "imagenet"
  config.optimizer.warmup_epochs = 1.0
  config.log_every = "20 steps"
  config.checkpoint_every = "200 steps"
  for evaluator in config.evaluators.values():
    evaluator.every = "500 steps"
  return config


def optimizer(name: str, base_lr: float, weight_decay: float, **overrides) -> dict:
  """An optimizer config (methods/optim.py): warm-up then cosine by default, linear lr scaling.

  schedule 'step' multiplies the lr by decay_factor at each of decay_epochs;
  weight_decay_mask, lr_before_momentum and nesterov choose the reference's
  variant (methods/optim.py docstring). Rates, factors and epochs are floats whatever the
  caller wrote (warmup_epochs=0 is 0.0): a ConfigDict field keeps the type of its first value,
  and --config.optimizer.warmup_epochs=0.5 must parse in every config.
  """
  config = dict(
    name=name,
    base_lr=base_lr,
    lr_scaling="linear",
    weight_decay=weight_decay,
    weight_decay_mask="kernels",
    momentum=0.9,
    nesterov=False,
    lr_before_momentum=False,
    trust_coefficient=0.001,
    warmup_epochs=10.0,
    schedule="cosine",
    decay_epochs=(),
    decay_factor=0.1,
  )
  config.update(overrides)
  for key in (
    "base_lr",
    "weight_decay",
    "momentum",
    "trust_coefficient",
    "warmup_epochs",
    "decay_factor",
  ):
    config[key] = float(config[key])
  config["decay_epochs"] = tuple(float(epoch) for epoch in config["decay_epochs"])
  return config


def imagenet(config, *, batch_size: int, num_epochs: int, reference: str):
  """Sets ImageNet (TFDS imagenet2012, 224 px) data fields and a ResNet-50 in bfloat16
  initialised as `reference`'s (see model()).

  The kNN bank is 10% of train (128k x 2048 floats, 1 GB over the devices);
  the evaluators run every 10 epochs on the validation split.
  """
  config.dataset = "imagenet2012"
  config.image_size = 224
  config.eval_crop_fraction = 0.875
  config.cache = False
  config.data_threads = 32
  config.batch_size = batch_size
  config.duration = f"{num_epochs} epochs"
  config.model = model("resnet50", "imagenet", "bfloat16", reference)
  config.checkpoint_every = "2000 steps"
  for evaluator in config.evaluators.values():
    evaluator.split = "validation"
    evaluator.batch_size = 1024
  config.evaluators.knn.bank_split = "train[:10%]"
  return config


def images(config, *, batch_size: int, num_epochs: int, reference: str):
  """Sets an image folder prepared by the prepare job as the data: 224 px, a ResNet-18
  initialised as `reference`'s (see model()).

  Name the folder's dataset with --config.dataset=NAME --config.data_dir=DIR
  (the default 'clothing' is docs/images.md's example); --config.image_size from
  64 to 224 suits the ImageNet stem. The kNN monitor votes with k = 20: the
  bank is a folder's train split, thousands of images rather than ImageNet's
  1.28 M, and 200 neighbours would be a large share of a small class. A
  dataset without labels takes no evaluators (--config.evaluators='{}').
  """
  config.dataset = "clothing"
  config.image_size = 224
  config.eval_crop_fraction = 0.875
  config.cache = False  # A folder may hold millions of photos; runlocal caches.
  config.shuffle_buffer = 10_000
  config.batch_size = batch_size
  config.duration = f"{num_epochs} epochs"
  config.model = model("resnet18", "imagenet", "float32", reference)
  config.evaluators.knn.k = 20
  return config


def runlocal_images(config, *, steps: int):
  """Shrinks an image-folder config for a 2-core CPU, same code path.

  64 px crops, ResNet-18 at width 0.25 (16 to 128 channels), batch 128,
  decoded images cached in memory, `steps` steps, evaluators every
  steps / 4. Sized for about 10 minutes of a 2-core CPU.
  """
  config.image_size = 64
  config.batch_size = 128
  config.duration = f"{steps} steps"
  config.model.width = 0.25
  config.cache = True
  config.optimizer.warmup_epochs = 1.0
  config.log_every = "10 steps"
  config.checkpoint_every = f"{steps // 4} steps"
  for evaluator in config.evaluators.values():
    evaluator.every = f"{steps // 4} steps"
    evaluator.batch_size = 256
  return config
