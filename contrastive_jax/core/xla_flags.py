"""The XLA options this project's programs run with, merged into the user's XLA_FLAGS, and
the check that names a user's flag XLA refuses (core/runtime.py sets them).

XLA:CPU (JAX 0.10 and 0.11) hands convolutions, dots and reductions to YNNPACK by
default, and YNNPACK runs each convolution on one thread, where XLA's own (Eigen)
convolutions use every core: without YNNPACK's convolutions the project's CPU steps
take less time (docs/throughput.md has the figures); YNNPACK keeps the dots and
reductions, where it is the faster. XLA's other backends do not read the option.
"""

import os
import re
import subprocess
import sys

YNN_OPTION = "--xla_cpu_experimental_ynn_fusion_type"
# Relative to XLA's default set of YNNPACK fusion kinds.
YNN_FUSION_TYPE = "-individual_convolution"
# Starts XLA's CPU client, which parses XLA_FLAGS and aborts on a flag it refuses.
_START_CPU_CLIENT = "from jaxlib import xla_client; xla_client.make_cpu_client()"
# A glog line: severity, date, time, thread, file:line] message.
_LOG_LINE = re.compile(r"^([EF])\d{4} [\d:.]+\s+\d+ [\w.\-]+:\d+\] (.*)$")


def merged(flags: str, options=(), ynn_fusion_type: str | None = YNN_FUSION_TYPE) -> str:
  """flags (an XLA_FLAGS value) with options (more flags, each once) and
  YNN_OPTION=ynn_fusion_type added unless flags set that option to another value than this
  module's default (the user's value wins); ynn_fusion_type None adds no YNN_OPTION.

  A YNN_OPTION equal to YNN_FUSION_TYPE, as a parent process passes it on, is replaced (or
  dropped, for None). flags that name a file (XLA reads flags from it when they do not
  start with '-') are returned as they are. ynn_fusion_type: XLA's syntax, kinds to drop
  from (-) or add to (+) its default set, comma separated.
  """
  flags = flags.strip()
  if flags and not flags.startswith("-"):
    return flags
  ours = f"{YNN_OPTION}={YNN_FUSION_TYPE}"
  words = list(dict.fromkeys([word for word in flags.split() if word != ours] + list(options)))
  users = any(re.match(re.escape(YNN_OPTION) + "(=|$)", word) for word in words)
  if ynn_fusion_type is not None and not users:
    words.append(f"{YNN_OPTION}={ynn_fusion_type}")
  return " ".join(words)


def refused(flags: str) -> str | None:
  """None where XLA's CPU client starts with XLA_FLAGS=flags, else one line naming the word
  of flags that XLA refused and XLA's reason, e.g. "XLA_FLAGS: XLA refused
  '--xla_force_host_platform_device_count=abc' (Couldn't interpret value abc for flag
  xla_force_host_platform_device_count.)".

  XLA reads XLA_FLAGS once, when its first client starts, and ends the process on a bad
  one (a value it cannot parse, an unknown flag, a file it cannot open: a word without its
  dashes names a file) with a fatal log line and, for a value, 77 lines of help. So the
  client starts in a short child process (about 0.4 s on a 2-core CPU): jaxlib's CPU
  client, which parses every XLA flag, whatever backend this process will use, and
  initialises no accelerator. A child that does not end in 60 s counts as a pass.
  """
  try:
    done = subprocess.run(
      [sys.executable, "-c", _START_CPU_CLIENT],
      env=dict(os.environ, XLA_FLAGS=flags),
      capture_output=True,
      text=True,
      timeout=60,
      check=False,
    )
  except subprocess.TimeoutExpired:
    return None
  if done.returncode == 0:
    return None
  logged = [m.groups() for m in map(_LOG_LINE.match, done.stderr.splitlines()) if m]
  # XLA logs the flag's own error, then a fatal "Flag parsing failed"; or a fatal line alone.
  reasons = [m for severity, m in logged if severity == "E"] or [m for _, m in logged]
  if not reasons:
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"XLA_FLAGS={flags!r}: XLA did not start with them (exit {done.returncode}): {last}"
  reason = reasons[0]
  words = flags.split()
  named = [w for w in words if w in reason] or [
    w for w in words if w.lstrip("-").split("=")[0] and w.lstrip("-").split("=")[0] in reason
  ]
  return f"XLA_FLAGS: XLA refused {(named or [flags])[0]!r} ({reason}); correct or remove it"
