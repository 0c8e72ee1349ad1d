"""Embeddings of a dataset split or a folder of images (config.job='embed').

  python -m contrastive_jax.main --config=configs/embed.py --workdir=EMBED_DIR \
      --config.pretrain_workdir=PRETRAIN_DIR --config.dataset=cifar10 --config.split=test
  python -m contrastive_jax.main --config=configs/embed.py --workdir=EMBED_DIR \
      --config.pretrain_workdir=PRETRAIN_DIR --config.folder=/photos
  python -m contrastive_jax.main --config=configs/embed.py --workdir=EMBED_DIR \
      --config.add=True --config.folder=/photos_new

Set the pretraining workdir and either a dataset (data_source, dataset,
data_dir, split) or a folder of image files. The encoder's architecture,
image size and centre crop come from the checkpoint's own config. With add,
the folder's files not yet in the index of EMBED_DIR are added to it, with
the index's checkpoint (pretrain_workdir may be left unset).

ann: the ANN index built beside the embeddings (jobs/ann.py, docs/search.md):
type 'auto' (exact 'flat' below 100,000 rows, 'ivf' from there; none, with a warning,
when FAISS is not installed; within max_memory, the first of those, then 'ivfsq8', then
'ivfpq8' of fewer bytes a row, that fits), 'flat', 'hnsw', 'ivf', 'ivfpq', 'ivfsq8',
'ivfpq8' (IVF lists of SQ8 or 8-bit PQ codes, re-ranked with the rows of the shards) or
'none'; a
parameter of 0 takes its measured default, but nprobe, which is calibrated: the
smallest that finds `recall` of the 10 nearest of the index's own rows (a sample,
against exact search), when the index is built and after each add.

engine: 'jax' embeds on this job's processes (one or many hosts); 'beam' on an Apache Beam
runner's workers (the [beam] extra; runner, num_workers, beam_options), the same shards.
"""

import ml_collections
from ml_collections import config_dict

from contrastive_jax import config_files

ARGS = {}


def get_config(arg: str = ""):
  config_files.parse_args(arg, ARGS)
  config = ml_collections.ConfigDict()
  config.job = "embed"
  config.pretrain_workdir = config_dict.placeholder(str)  # Or a weights file (docs/weights.md),
  config.pretrain_config = config_dict.placeholder(str)  # then its model's configs/X.py[:ARG,...].
  config.pretrain_step = -1  # -1: the latest checkpoint.
  config.random_init = False  # True: the pretraining run's encoder at initialisation (baseline).
  config.model_name = config_dict.placeholder(str)  # If set, the checkpoint's model must match.
  config.data_source = "tfds"
  config.dataset = config_dict.placeholder(str)  # e.g. 'cifar10' or a prepared image folder.
  config.data_dir = config_dict.placeholder(str)  # None: TFDS_DATA_DIR or ~/tensorflow_datasets.
  config.split = "test"
  config.folder = config_dict.placeholder(str)  # A folder of image files, instead of a dataset.
  config.max_pixels = 100_000_000  # Files whose header claims more are not decoded.
  config.batch_size = 256  # Global; a multiple of the device count.
  config.data_threads = 2
  config.shard_rows = 100_000  # Images per shard file (docs/search.md): what a process holds.
  config.add = False  # True: add config.folder's new files to the index in --workdir.
  config.engine = "jax"  # Who embeds: 'jax' (this job's processes) or 'beam' (docs/search.md).
  config.runner = "DirectRunner"  # engine 'beam': the Beam runner, e.g. 'DataflowRunner'.
  config.num_workers = 0  # engine 'beam', DirectRunner: worker processes; 0: one per core.
  config.beam_options = ""  # engine 'beam': more Beam pipeline options, e.g. '--project=P'.
  config.ann = ml_collections.ConfigDict(
    dict(
      type="auto",
      hnsw_m=0,  # HNSW: graph links per node (M); 0: 32.
      ef_construction=0,  # HNSW: candidates kept while linking (efConstruction); 0: 40.
      ef_search=0,  # HNSW: candidates kept while searching (efSearch); 0: 256.
      nlist=0,  # IVF, IVFPQ: k-means lists; 0: 4 sqrt(N), a power of two.
      nprobe=0,  # IVF, IVFPQ: lists searched per query; 0: calibrated.
      k_factor=0,  # IVFPQ: candidates re-ranked exactly per neighbour; 0: 50 (IVFSQ8, IVFPQ8: 10).
      pca=0,  # IVFSQ8: dimensions a PCA keeps before the lists and codes; 0: no PCA.
      pq_m=0,  # IVFPQ8: bytes of code per row (divides D); 0: D / 4, or what max_memory fits.
      opq=False,  # IVFPQ8: an OPQ rotation before the codes ('auto' in a budget tries it first).
      max_memory="",  # The index's memory budget, e.g. '4GB' or bytes; '': none (docs/search.md).
      recall=0.95,  # What nprobe at 0 is calibrated to: recall@10.
      threads=0,  # FAISS threads while building; 0: every core.
    )
  )
  return config
