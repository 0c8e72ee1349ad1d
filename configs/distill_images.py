"""Distillation on an image folder prepared by the prepare job: LightlyTrain's distillation
(v1, v2, v3) from a frozen teacher into a ResNet-18.

  python -m contrastive_jax.main --config=configs/distill_images.py \\
      --config.dataset=NAME --config.data_dir=DIR \\
      --config.distill.teacher=dinov3_vits16_pretrain_lvd1689m.pth --workdir=RUN

The reference's defaults (lightly-ai/lightly-train src/lightly_train/_methods/
distillation*/ and _commands/train.py): loss v3 from a DINOv3 teacher (DistillationV3Args.
teacher 'dinov3/vitb16'), temperatures 0.07, local weight 1.0, v2's
last 2 teacher blocks; one view mixed up with a permutation of the batch at l ~ U(0, 1);
RandomResizedCrop scale 0.14-1, flip, ColorJitter (0.4, 0.4, 0.2, 0.1) p 0.8, grayscale
p 0.2 (recipes.distillation_views); v3 AdamW lr 5e-4 with weight decay 1e-6 (a ResNet
student), v1 LARS 1.8, v2 LARS 9.0, each x sqrt(B / 1536), warm-up min(10, epochs / 10)
epochs, cosine to 0, gradients clipped at global norm 1.0; batch 128 and 100 epochs.

Where it departs from the reference, and why: the queue is 2048, the reference's 'auto'
for a folder of 4,000 to 10,000 images (set --config.distill.queue_size to its value for
yours, distillation.reference_queue_size; the job refuses one not below the split's
size); the teacher is DINOv3's ViT-S/16 (`teacher_model`; the reference's default is its
ViT-B/16, about 4x the cost per image; v1 and v2 keep it, where the reference's default
is DINOv2's ViT-B/14); images at 224 px (a multiple of 16 and of 14) and a ResNet-18
student as the project's other image-folder configs; the queue and the mix-up over the
global batch (methods/distillation.py).

Arguments (--config=configs/distill_images.py:ARG,ARG...):
  `loss=v3` (the default), `v1` or `v2`;
  `teacher_model=vit_small_patch16_dinov3` (the default), any configs/dinov3.py or
      configs/dinov2.py name, or `checkpoint` for a pretraining or fine-tuning workdir of
      this package;
  `runlocal`: recipes.runlocal_images (64 px: 4 x 16), 56 px (4 x 14) with a DINOv2 or
      workdir teacher, ResNet-18 at width 0.25, batch 128, 400 steps;
  `dtype=float32` (the default) or `dtype=bfloat16`: the student's compute dtype.

Preparing a folder and its configs: docs/images.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(
  runlocal=False,
  loss=("v3", "v1", "v2"),
  teacher_model=recipes.teacher_models("vit_small_patch16_dinov3"),
  dtype=("float32", "bfloat16"),
)
EPOCHS = 100


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS)
  config = recipes.images(
    recipes.base_config(), batch_size=128, num_epochs=EPOCHS, reference="torchvision"
  )
  config.method = "distillation"
  config.distill = recipes.distillation(
    args.loss, recipes.distillation_teacher(args.teacher_model), queue_size=2048
  )
  config.crop = recipes.crop("torchvision", 0.14, "pil_bilinear")
  config.augment = recipes.distillation_views()
  config.optimizer = recipes.distillation_optimizer(args.loss, False, EPOCHS)
  if args.runlocal:
    recipes.runlocal_images(config, steps=400)
    if args.teacher_model not in recipes.DINOV3_MODELS:
      config.image_size = 56
  config.model.dtype = args.dtype
  return config
