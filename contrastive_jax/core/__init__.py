"""What knows no model: errors, files and workdirs, checkpoints, metrics, pictures, gs://,
the mesh, XLA's options, glibc's malloc tunables."""
