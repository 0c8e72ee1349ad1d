"""DINO on CIFAR-10: the DINO reference's default command with its two global views.

The command reproduced (facebookresearch/dino README, "Vanilla DINO training", its
argparse defaults otherwise):
  python -m torch.distributed.launch --nproc_per_node=8 main_dino.py --arch vit_small
      --data_path /path/to/imagenet/train --output_dir /path/to/saving_dir
i.e. 8 GPUs x 64 = batch 512, 100 epochs; DINO head (3 layers, hidden 2048, GELU,
bottleneck 256, L2 normalisation, weight-normalised last layer of 65536 outputs with
norm_last_layer True, no BN); teacher momentum 0.996 -> 1 (cosine); student
temperature 0.1, teacher temperature 0.04 (--warmup_teacher_temp 0.04
--teacher_temp 0.04 --warmup_teacher_temp_epochs 0); centre momentum 0.9; AdamW
(b1 0.9, b2 0.999) at lr 0.0005 x B/256 after a 10-epoch linear warm-up, cosine to
1e-6; weight decay 0.04 -> 0.4 (cosine) on kernels only (not on biases or norms);
each gradient tensor clipped at norm 3.0; the last layer frozen for the first epoch;
views: RandomResizedCrop (bicubic), flip, ColorJitter(0.4, 0.4, 0.2, 0.1) p 0.8,
grayscale p 0.2, view 1 blurred (PIL, sigma 0.1-2), view 2 blurred with p 0.1 and
solarised with p 0.2 (recipes.mocov3_views has the same ops and probabilities);
ImageNet's normalisation; kNN monitor as eval_knn.py (k 20, temperature 0.07).

Where it departs from that command, and why: CIFAR-10's 32 px images and a ViT-Tiny
at patch 4 (64 patches and the class token) with a learned position embedding
instead of ImageNet's 224 px ViT-S/16; by default no multi-crop (local_crops
below), so the two global views only, with crop scale 0.14-1 (main_dino.py's advice
when local_crops_number is 0, instead of 0.4-1); the ViT student's stochastic depth is
the reference's (--drop_path_rate 0.1) but off in runlocal; the ViT's initialisation is MoCo v3's
(models/vit.py), not DINO's trunc_normal(0.02). DINO publishes no CIFAR-10 recipe
or result: no target is checked.

Arguments (--config=configs/dino_cifar10.py:ARG,ARG..., e.g. :runlocal,model=resnet18):
  `model=vit_tiny` (the default) or `model=resnet18`: a ResNet-18 (CIFAR stem,
      torchvision's initialisation) with the reference's ResNet-50 command's
      optimiser (README: --arch resnet50 --optimizer sgd --lr 0.03 --weight_decay
      1e-4 --weight_decay_end 1e-4 --global_crops_scale 0.14 1): SGD momentum 0.9,
      lr 0.03 x B/256, weight decay 1e-4 on kernels, the rest as above.
  `runlocal`: shrunk for a 2-core CPU: batch 256, the train split held and cropped
      on the device (on_device_data: crops of the same distributions drawn there, so
      the host's bicubic resizes do not share the 2 cores with the step; other draws,
      so an older runlocal's workdir resumes only with its own config's fields, which
      the resume check names), warm-up of 1 epoch,
      teacher momentum 0.99 (0.996 barely moves the teacher in a few thousand steps),
      the teacher temperature 0.04 throughout as the default command (a warm-up to
      0.07 over 2 epochs sent both runlocals' teachers to the uniform distribution at
      the step, docs/results.md); each as many steps as 15 minutes here hold with
      room to spare; both with the head of lightly's CIFAR-10 benchmark recipe for
      DINO (benchmarks/cifar10: 2 layers of hidden 2048 with BN, bottleneck 256, 2048
      outputs), with which both learned faster than with the reference's
      (docs/results.md). The ViT at D 96 (width 0.5), 4 blocks, patch 8, with MoCo
      v3's fixed sine-cosine position embedding instead of the reference's learned
      one (which starts as noise and has few steps here to learn), a learning rate of
      1e-3 x B/256 (2x the reference's, MoCo v3's ViT runlocal's), no blur on the two
      global views (the ViT alone: it cost 4% of its step, and the ViT needs the
      time; local_crops' local views keep p 0.5), no stochastic depth, 1800 steps
      (about 9 epochs), evaluators every 900 steps: 13 min 34 s, +10.2 kNN points
      (each change's measurements in docs/results.md). The ResNet-18 at width 0.25 with the
      ImageNet stem (recipes.runlocal), 3200 steps (about 16 epochs), evaluators
      every 800 steps, and lightly's optimiser (SGD at 0.06 x B/128, i.e. 0.12 x
      B/256, weight decay 5e-4): 12 minutes, +10.2 kNN points.
  `local_crops=0` (the default) or 2, 4, 6, 8, 10: multi-crop with that many local
      views of 16 px (area 0.05-0.4, blur p 0.5), the global views' scale then 0.4-1
      as the reference's default command, cropped where the global views are (on
      the device in runlocal; a runlocal with them keeps its steps, each dearer by
      the local views' passes through the student); the ViT's learned
      position embedding is interpolated to the local views' grid (4 x 4 at patch 4)
      as the reference's interpolate_pos_encoding, runlocal's sine-cosine one computed
      for theirs (2 x 2).
  `dtype=float32` (the default) or `dtype=bfloat16`: the encoder's compute dtype.
Variant `runlocal_resnet`: runlocal,model=resnet18.

The recipes and their sources: docs/recipes.md; the runs measured: docs/results.md.
"""

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(
  runlocal=False,
  model=("vit_tiny", "resnet18"),
  dtype=("float32", "bfloat16"),
  local_crops=(0, 2, 4, 6, 8, 10),
)
VARIANTS = {"runlocal_resnet": "runlocal,model=resnet18"}


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS, VARIANTS)
  config = recipes.base_config()
  config.method = "dino"
  config.batch_size = 512
  config.duration = "100 epochs"
  config.dino = recipes.dino()
  config.crop = recipes.crop("torchvision", 0.14, "pil_bicubic")
  config.augment = recipes.mocov3_views()
  config.evaluators.knn.k = 20
  config.evaluators.knn.temperature = 0.07
  if args.model == "vit_tiny":
    config.model = recipes.vit_model("vit_tiny", 4, "float32", random_patch_projection=False)
    config.model.position_embedding = "learned"
    config.optimizer = recipes.dino_optimizer("adamw", 0.0005, 0.04, 0.4)
  else:
    config.model = recipes.model("resnet18", "cifar", "float32", "torchvision")
    config.dino.drop_path_rate = 0.0  # The reference passes it to its ViTs only.
    config.optimizer = recipes.dino_optimizer("sgd", 0.03, 1e-4, None)
  if args.runlocal:
    recipes.runlocal(config)
    config.on_device_data = True
    config.dino.momentum_teacher = 0.99
    config.dino.update(out_dim=2048, hidden_dim=2048, num_layers=2, use_bn_in_head=True)
    if args.model == "vit_tiny":
      del config.model.stem  # recipes.runlocal's ResNet stem.
      config.model.update(width=0.5, depth=4, patch_size=8, position_embedding="sincos")
      config.optimizer.base_lr = 0.001
      for view in config.augment.values():
        view.blur_prob = 0.0
      config.dino.drop_path_rate = 0.0
      config.duration, every = "1800 steps", "900 steps"
    else:
      config.optimizer.update(base_lr=0.12, weight_decay=5e-4)
      config.duration, every = "3200 steps", "800 steps"
    for evaluator in config.evaluators.values():
      evaluator.every = every
  if args.local_crops:
    # Multi-crop as the reference's default command (global views at scale 0.4-1, local
    # views at 0.05-0.4), the local views of 16 px here (96 / 224 of 32 px is 13.7; 16
    # divides into the ViT's patches).
    recipes.dino_multi_crop(
      config, number=args.local_crops, size=16, global_scale=0.4, local_scale=(0.05, 0.4)
    )
  config.model.dtype = args.dtype
  return config
