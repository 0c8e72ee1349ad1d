"""Distillation on ImageNet: LightlyTrain's distillation v3 from a DINOv3 teacher.

  python -m contrastive_jax.main --config=configs/distill_imagenet.py \\
      --config.distill.teacher=dinov3_vitb16_pretrain_lvd1689m.pth --workdir=RUN

The reference's defaults (lightly-ai/lightly-train src/lightly_train/_methods/
distillation*/ and _commands/train.py): loss v3 (its default method) from DINOv3's ViT-B/16
(DistillationV3Args.teacher 'dinov3/vitb16'), temperatures 0.07,
local weight 1.0, v2's last 2 teacher blocks, a queue of 8192 (its 'auto' for 20,000
images or more); one view mixed up with a permutation of the batch at l ~ U(0, 1);
RandomResizedCrop at 224 px, scale 0.14-1, flip, ColorJitter (0.4, 0.4, 0.2, 0.1) p 0.8,
grayscale p 0.2 (recipes.distillation_views); v3 AdamW lr 5e-4 (weight decay 1e-6 for the
ResNet-50 student, 0.04 for a ViT), v1 LARS 1.8, v2 LARS 9.0 (weight decay 1e-6), each x
sqrt(B / 1536), 10 warm-up epochs and a cosine to 0, gradients clipped at global norm 1.0
(recipes.distillation_optimizer); 100 epochs (MethodArgs.default_epochs).

Where it departs from the reference, and why: v1 and v2 keep v3's DINOv3 ViT-B/16 teacher
(the reference's v1 and v2 default to DINOv2's ViT-B/14 without registers,
DistillationArgs.teacher 'dinov2/vitb14-noreg': `teacher_model=vit_base_patch14_dinov2`
for it), so that the three losses differ only in the loss; the batch is 1536, the
reference's reference batch (its command's default of 128 is a one-GPU example); a
ResNet-50 student in bfloat16 (the user's model in the reference); the queue and the
mix-up over the global batch (methods/distillation.py).

Arguments (--config=configs/distill_imagenet.py:ARG,ARG...):
  `loss=v3` (the default), `v1` or `v2`;
  `model=resnet50` (the default), `resnet18`, `vit_small` or `vit_tiny` (patch 16): the student;
  `teacher_model=vit_base_patch16_dinov3` (the default), any configs/dinov3.py or
      configs/dinov2.py name (224 px is a multiple of both patches, 16 and 14), or
      `checkpoint` for a pretraining or fine-tuning workdir of this package;
  `dtype=bfloat16` (the default) or `dtype=float32`: the student's compute dtype.

The recipes and their sources: docs/recipes.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(
  loss=("v3", "v1", "v2"),
  model=("resnet50", "resnet18", "vit_small", "vit_tiny"),
  teacher_model=recipes.teacher_models("vit_base_patch16_dinov3"),
  dtype=("bfloat16", "float32"),
)
EPOCHS = 100


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS)
  config = recipes.base_config()
  config.method = "distillation"
  recipes.imagenet(config, batch_size=1536, num_epochs=EPOCHS, reference="torchvision")
  config.distill = recipes.distillation(args.loss, recipes.distillation_teacher(args.teacher_model))
  config.crop = recipes.crop("torchvision", 0.14, "pil_bilinear")
  config.augment = recipes.distillation_views()
  vit = args.model.startswith("vit")
  if vit:
    config.model = recipes.vit_model(args.model, 16, "bfloat16", random_patch_projection=False)
  elif args.model == "resnet18":
    config.model.name = "resnet18"
  config.optimizer = recipes.distillation_optimizer(args.loss, vit, EPOCHS)
  config.model.dtype = args.dtype
  return config
