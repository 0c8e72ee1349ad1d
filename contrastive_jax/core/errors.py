"""Expected failures: each ends a job with one line and a non-zero exit (main.py)."""

import difflib
from typing import Iterable, Optional

ABSENT = "<absent>"  # How ResumeError shows a field one config has and the other lacks.


class JobError(Exception):
  """A failure the user can act on; its message is the whole report (no traceback)."""


class ConfigError(JobError, ValueError):
  """A config field (or the data/checkpoint it points to) that cannot run.

  Raised before any training step (a downstream job may have read its
  checkpoint by then). The message names the field, the value and what is
  allowed, e.g. "config.temperature=-1.0: must be > 0".
  """

  def __init__(self, field: str, value, allowed: str):
    self.field, self.value, self.allowed = field, value, allowed
    super().__init__(f"config.{field}={value!r}: must be {allowed}")


class ResumeError(ConfigError):
  """A resumed job's config differs from its checkpoint's in fields that must stay the same.

  Attributes:
    differences: [(dotted field, the checkpoint's value, this run's value)],
      sorted by field; ABSENT stands for a field one of the two configs lacks.
  """

  def __init__(self, directory: str, differences, may_change):
    self.differences = differences
    self.field, self.value, self.allowed = differences[0][0], differences[0][2], None
    listed = "; ".join(
      f"config.{field}={now!r} (the checkpoint's: {saved!r})" for field, saved, now in differences
    )
    JobError.__init__(
      self,
      f"{listed}: a resumed run must keep its checkpoint's config (in {directory}) "
      f"except {', '.join(may_change)}. Use a new workdir for a different run, or the "
      "checkpoint's values to resume it",
    )


class ForeignCheckpointError(JobError):
  """A numbered folder among a workdir's checkpoints that no job of this project wrote
  (another tool's Orbax checkpoint, or any other folder): never restored nor deleted."""


class WeightsError(JobError):
  """A weights file (safetensors, .pth) that cannot be read into, or written from, an encoder:
  not such a file, another architecture or size, missing or unexpected tensors.

  Attributes:
    path: the file, as given.
    reason: why, in words, naming the first tensor or shape that does not fit.
  """

  def __init__(self, path: str, reason: str):
    self.path, self.reason = path, reason
    super().__init__(f"{path}: {reason}")


class NonFiniteError(JobError):
  """The loss or the parameters became NaN or infinite; nothing of that step was saved."""


class ImageError(JobError):
  """An image file that cannot be used: unreadable, not an image, truncated, too large.

  Attributes:
    path: the file, as given.
    reason: why, in words (e.g. "truncated: image file is truncated").
  """

  def __init__(self, path: str, reason: str):
    self.path, self.reason = path, reason
    super().__init__(f"{path}: {reason}")


class VariantError(JobError):
  """A config file's get_config(arg) given an argument, value or variant it does not take
  (config_files.parse_args).

  Attributes:
    given: the word, argument name or value as given.
    known: what the file takes in its place; the closest of them is named in the message.
  """

  def __init__(self, message: str, given: str, known: Iterable[str]):
    self.given, self.known = given, tuple(known)
    guess = closest(given, self.known)
    super().__init__(message + (f"; did you mean {guess!r}?" if guess else ""))


def closest(name: str, candidates: Iterable[str]) -> Optional[str]:
  """The candidate most like name (difflib's ratio of at least 0.6), or None."""
  matches = difflib.get_close_matches(name, list(candidates), n=1)
  return matches[0] if matches else None


class Interrupted(JobError):
  """Ctrl-C (SIGINT) stopped the job; the message says at which step and what is kept."""


class NoSpaceError(JobError):
  """The disk (or quota) of the workdir is full; the message says what is kept."""


class DataError(JobError):
  """A record of a prepared dataset that cannot be read: its file truncated or altered since
  it was written. The message names the file and the record, and what to do.

  Attributes:
    path: the file.
    record: the index in that file of the record that could not be read.
  """

  def __init__(self, path: str, record: int, message: str):
    self.path, self.record = path, record
    super().__init__(message)
