"""Durations in a config: 'N steps' or 'N epochs'.

A duration stays in the unit it was written in until the job knows its
dataset size and global batch; to_steps resolves it then.
"""

import re

from contrastive_jax.core.errors import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(steps?|epochs?)\s*$")


def _parse_duration(value, field: str):
  """(N, 'steps' or 'epochs') of a duration string; ConfigError unless N > 0 (whole for steps)."""
  match = _DURATION.match(str(value))
  number = float(match.group(1)) if match else 0.0
  unit = "steps" if match and match.group(2).startswith("step") else "epochs"
  if not match or number <= 0 or (unit == "steps" and number != int(number)):
    raise ConfigError(
      field, value, "a duration 'N steps' or 'N epochs' with N > 0 (steps a whole number)"
    )
  return number, unit


def check_duration(value, field: str):
  """Raises ConfigError unless value reads 'N steps' or 'N epochs' (checked before any compute)."""
  _parse_duration(value, field)


def to_steps(value, field: str, steps_per_epoch: int) -> int:
  """Resolves a duration such as '500 steps' or '10 epochs' to optimizer steps.

  Durations stay in the unit they were written in until the job knows its
  dataset size and global batch: '10 epochs' is 10 * steps_per_epoch steps
  (rounded to the nearest step) whatever --config.batch_size says.

  Raises:
    ConfigError: not of the form 'N steps' / 'N epochs' (N > 0; steps whole),
      or a duration that rounds to 0 steps.
  """
  number, unit = _parse_duration(value, field)
  steps = int(number) if unit == "steps" else int(round(number * steps_per_epoch))
  if steps <= 0:
    raise ConfigError(
      field,
      value,
      f"a duration of at least one step; at {steps_per_epoch} steps per epoch it rounds to 0 steps",
    )
  return steps
