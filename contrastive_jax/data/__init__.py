"""Data: sources (TFDS datasets, image folders), the tf.data pipelines, crops and on-device
augmentations."""
