"""The one error type for input that cannot run."""


class ConfigError(ValueError):
  """A config field (or the data/workdir it points to) that cannot run.

  Raised before any compute. The message names the field, the value and what
  is allowed, e.g. "config.temperature=-1.0: must be > 0".
  """

  def __init__(self, field: str, value, allowed: str):
    self.field, self.value, self.allowed = field, value, allowed
    super().__init__(f"config.{field}={value!r}: must be {allowed}")
