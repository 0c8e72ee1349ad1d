"""DINO on an image folder prepared by the prepare job (Caron et al. 2021; facebookresearch/dino).

  python -m contrastive_jax.main --config=configs/dino_images.py \\
      --config.dataset=NAME --config.data_dir=DIR --workdir=RUN

The recipe of the reference README's ResNet command ("ResNet-50 and other
convnets trainings"):
  main_dino.py --arch resnet50 --optimizer sgd --lr 0.03 --weight_decay 1e-4
      --weight_decay_end 1e-4 --global_crops_scale 0.14 1 --local_crops_scale 0.05 0.14
with main_dino.py's defaults otherwise: SGD momentum 0.9 at lr 0.03 x B/256 after
10 warm-up epochs, cosine to 1e-6, weight decay 1e-4 on kernels, each gradient
tensor clipped at 3.0, the last layer held for the first epoch; the DINO head of
65536 outputs (norm_last_layer True), teacher momentum 0.996 -> 1, teacher
temperature 0.04, student 0.1, centre momentum 0.9; 2 global views at crop
scale 0.14-1 and 8 local views of 96 px at 0.05-0.14 (DataAugmentationDINO's
jitter, grayscale, blur and solarisation). kNN monitor (k 20, temperature
0.07, on the teacher) and online probe on the test split; an unlabeled folder
needs --config.evaluators='{}'.

Where it departs from the command, and why: as the project's other image-folder
configs, a ResNet-18 (ImageNet stem) at 224 px, batch 256 (one accelerator) and
200 epochs (a folder holds thousands of images, not ImageNet's 1.28 M). With
--config.image_size below 224, set --config.local_crops.size to 96 / 224 of it.

Arguments (--config=configs/dino_images.py:ARG,ARG...):
  `runlocal`: 64 px, ResNet-18 at width 0.25, batch 128, 400 steps
      (recipes.runlocal_images) with 4 local views of 28 px, a head of 4096
      outputs (hidden 512, bottleneck 128) and teacher momentum 0.99 (as
      dino_cifar10.py's runlocal);
  `dtype=float32` (the default) or `dtype=bfloat16`: the encoder's compute dtype.

Preparing a folder and its configs: docs/images.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(runlocal=False, dtype=("float32", "bfloat16"))


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS)
  config = recipes.images(
    recipes.base_config(), batch_size=256, num_epochs=200, reference="torchvision"
  )
  config.method = "dino"
  config.dino = recipes.dino(drop_path_rate=0.0)  # The reference's is its ViTs' only.
  config.augment = recipes.mocov3_views()
  config.crop = recipes.crop("torchvision", 0.14, "pil_bicubic")
  config.evaluators.knn.temperature = 0.07
  config.optimizer = recipes.dino_optimizer("sgd", 0.03, 1e-4, None)
  recipes.dino_multi_crop(config, number=8, size=96, global_scale=0.14, local_scale=(0.05, 0.14))
  if args.runlocal:
    recipes.runlocal_images(config, steps=400)
    config.local_crops.update(number=4, size=28)
    config.dino.update(out_dim=4096, hidden_dim=512, bottleneck_dim=128, momentum_teacher=0.99)
  config.model.dtype = args.dtype
  return config
