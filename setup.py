"""Installs the contrastive_jax package (library and training jobs)."""

import setuptools

setuptools.setup(
  name="contrastive_jax",
  version="0.1.0",
  description="Contrastive self-supervised learning (SimCLR, MoCo, BYOL) in JAX/Flax.",
  packages=setuptools.find_packages(include=["contrastive_jax", "contrastive_jax.*"]),
  python_requires=">=3.10",
  # Ranges from the versions the suite runs at (constraints.txt pins them: install with
  # `-c constraints.txt` to reproduce it exactly) through the newest releases the train path
  # was run at (JAX 0.11.2, flax 0.12.12: docs/gpu.md). TensorFlow and TFDS are the host
  # input pipeline's (tf.data) and the data jobs'; the train step, checkpoints and metrics
  # import neither, so an accelerator image with JAX alone runs them (docs/gpu.md).
  install_requires=[
    "absl-py",
    "clu>=0.0.12,<0.1",
    "etils[epath]",  # core/files.py: every path, local or gs://.
    "flax>=0.12.8,<0.13",
    "google-auth",  # gcs.py: the credentials check for gs:// paths.
    "google-cloud-storage",  # Orbax imports it for gs:// checkpoints (bucket query).
    "importlib_resources",  # TFDS needs it to write datasets (the prepare job).
    "jax>=0.10.2,<0.12",
    "jaxlib>=0.10.2,<0.12",
    "matplotlib>=3.8,<4",  # core/pictures.py, core/scatter.py: the charts (Agg, no display).
    "ml-collections>=1.1.0,<2",
    "numpy",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "pillow",
    "pyarrow>=25.0.1,<26",  # search/shards.py: the embed job's metadata shards (parquet).
    "tensorboard",
    "tensorflow-cpu>=2.21.0,<3",
    "tensorflow-datasets>=4.9.10,<5",
  ],
  extras_require={
    # NVIDIA GPUs: JAX's CUDA 13 plugin, with CUDA's libraries as wheels (docs/gpu.md).
    "cuda": ["jax[cuda13]>=0.10.2,<0.12"],
    # The prepare job runs on Apache Beam (reading prepared datasets does not).
    "beam": ["apache-beam==2.77.0"],
    # tests/gcs_emulator.py patches gaps of this emulator version; cryptography makes its
    # TLS certificate; ruff formats and lints (ruff.toml, .ci/run); pytest-xdist runs the
    # test files in one worker per core (the README's test command).
    "test": [
      "pytest",
      "pytest-xdist==3.8.0",
      "ruff==0.17.6",
      "gcp-storage-emulator==2026.7.19",
      "cryptography",
      "apache-beam==2.77.0",
      "onnx==1.23.2",
      "onnxruntime==1.32.0",
      "faiss-cpu==1.15.1",
      "scikit-learn==1.9.1",
      "umap-learn==0.5.12",
    ],
    # The ONNX export (configs/export.py, format 'onnx') and ONNX Runtime to read it.
    "onnx": ["onnx==1.23.2", "onnxruntime==1.32.0"],
    # The ANN index of the embed job and its search (jobs/ann.py, docs/search.md).
    "search": ["faiss-cpu==1.15.1"],
    # The map job (configs/map.py): UMAP, and scikit-learn's t-SNE, PCA and k-means.
    "map": ["scikit-learn==1.9.1", "umap-learn==0.5.12"],
    # Reading and writing .pth weights (torch.serialization.safe_globals: torch 2.5), the
    # live reference tests (docs/weights.md).
    "torch": ["torch>=2.5", "torchvision", "timm"],
  },
)
