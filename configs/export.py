"""Export of a pretrained encoder (config.job='export'; jobs/export.py, docs/weights.md).

  python -m contrastive_jax.main --config=configs/export.py --workdir=OUT \
      --config.pretrain_workdir=PRETRAIN_DIR --config.format=saved_model

config.format: 'safetensors' (a torchvision / timm state dict, numpy only), 'pth'
(the same through torch.save; needs torch), 'saved_model' (TF SavedModel with a
serving signature on uint8 images of any size) or 'onnx' (an ONNX model on uint8 images
centre-cropped to the image size; needs the onnx extra). The encoder's architecture, image
size and eval crop come from the checkpoint's own config. 'vertex' exports not the encoder
but the rows of the embed job's index in index_workdir, as Vertex AI Vector Search's JSON
input files (docs/search.md).
"""

import ml_collections
from ml_collections import config_dict

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = {}


def get_config(arg: str = ""):
  config_files.parse_args(arg, ARGS)
  config = ml_collections.ConfigDict()
  config.job = "export"
  recipes.pretrained_encoder_fields(config)
  config.format = "safetensors"
  config.projection = False  # saved_model and onnx: serve z (the projection head's output) too.
  config.index_workdir = config_dict.placeholder(str)  # 'vertex': the embed job's workdir.
  return config
