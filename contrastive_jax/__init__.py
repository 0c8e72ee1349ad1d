"""Contrastive self-supervised learning of image encoders in JAX/Flax."""
