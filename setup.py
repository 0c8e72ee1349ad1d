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
        "importlib_resources",  # TFDS needs it to write datasets (prepare_images).
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
    extras_require={"test": ["pytest"]},
)
