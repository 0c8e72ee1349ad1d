"""The command line that prepared image folders before the prepare job: it now says the new one.

  python -m contrastive_jax.data.prepare_images --src=DIR --name=NAME --data_dir=DIR2

ends with one line giving the same preparation as the prepare job's command
(jobs/prepare.py), each flag translated:

  python -m contrastive_jax.main --config=configs/prepare.py --workdir=DIR2 \
      --config.src=DIR --config.name=NAME
"""

import shlex
import sys

# Each flag of this command line: its field of configs/prepare.py (--data_dir: --workdir).
FIELDS = {
  "src": "src",
  "name": "name",
  "image_size": "image_size",
  "format": "format",
  "max_pixels": "max_pixels",
  "holdout_fraction": "holdout_fraction",
  "seed": "seed",
  "overwrite": "overwrite",
  "runner": "beam.runner",
  "direct_num_workers": "beam.direct_num_workers",
  "beam_options": "beam.options",
}


def new_command(argv) -> str:
  """The prepare job's command line for this command's arguments argv (argv[0] excluded).

  Raises:
    ValueError: an argument that is not one of this command's flags, naming it.
  """
  args, workdir = [], "DATA_DIR"
  argv = list(argv)
  while argv:
    arg = argv.pop(0)
    flag, has_value, value = arg.lstrip("-").partition("=")
    if not arg.startswith("-") or flag not in (*FIELDS, "data_dir", "nooverwrite"):
      raise ValueError(f"{arg!r} is not a flag of this command")
    if flag in ("overwrite", "nooverwrite") and not has_value:
      has_value, value = True, str(flag == "overwrite")
      flag = "overwrite"
    if not has_value:
      if not argv:
        raise ValueError(f"{arg!r} has no value")
      value = argv.pop(0)
    if flag == "overwrite":
      value = str(value.lower() in ("true", "1"))
    if flag == "data_dir":
      workdir = value
    else:
      args.append(f"--config.{FIELDS[flag]}={value}")
  return shlex.join(
    [
      "python",
      "-m",
      "contrastive_jax.main",
      "--config=configs/prepare.py",
      f"--workdir={workdir}",
      *args,
    ]
  )


def main(argv) -> str:
  """The one line this command ends with."""
  try:
    command = new_command(argv[1:])
  except ValueError as e:
    return (
      f"error: {e}; image folders are prepared by the prepare job: python -m "
      "contrastive_jax.main --config=configs/prepare.py --workdir=DATA_DIR "
      "--config.src=DIR --config.name=NAME (docs/images.md)"
    )
  return f"error: image folders are prepared by the prepare job now; run: {command}"


if __name__ == "__main__":
  sys.exit(main(sys.argv))
