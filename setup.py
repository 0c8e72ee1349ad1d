"""Installs the contrastive_jax package (library and training jobs)."""

import setuptools

setuptools.setup(
  name="contrastive_jax",
  version="0.1.0",
  description="Contrastive self-supervised learning (SimCLR, MoCo, BYOL) in JAX/Flax.",
  packages=setuptools.find_packages(include=["contrastive_jax", "contrastive_jax.*"]),
  python_requires=">=3.10",
  install_requires=[
    "absl-py",
    "clu==0.0.12",
    "flax==0.12.8",
    "google-auth",  # gcs.py: the credentials check for gs:// paths.
    "google-cloud-storage",  # Orbax imports it for gs:// checkpoints (bucket query).
    "importlib_resources",  # TFDS needs it to write datasets (the prepare job).
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "ml-collections==1.1.0",
    "numpy",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "pillow",
    "tensorboard",
    "tensorflow-cpu==2.21.0",
    "tensorflow-datasets==4.9.10",
  ],
  extras_require={
    # The prepare job runs on Apache Beam (reading prepared datasets does not).
    "beam": ["apache-beam==2.77.0"],
    # tests/gcs_emulator.py patches gaps of this emulator version; cryptography makes its
    # TLS certificate; ruff formats and lints (ruff.toml, .ci/run).
    "test": [
      "pytest",
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
    # Reading and writing .pth weights, the live reference tests (docs/weights.md).
    "torch": ["torch", "torchvision", "timm"],
  },
)
