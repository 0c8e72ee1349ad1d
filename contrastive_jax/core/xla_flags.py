"""The XLA options this project's programs run with unless the user's XLA_FLAGS set them.

XLA:CPU (JAX 0.10 and 0.11) hands convolutions, dots and reductions to YNNPACK by
default, and YNNPACK runs each convolution on one thread, where XLA's own (Eigen)
convolutions use every core. Without YNNPACK's convolutions the SimCLR `runlocal` step
took 0.096 s against 0.105 on a 2-core CPU, and a full-width ResNet-18's 3x3
convolutions 2 to 3 times less time (docs/throughput.md); YNNPACK keeps the dots and
reductions, where it is the faster. XLA's other backends do not read the option.
"""

import os
import re

YNN_OPTION = "--xla_cpu_experimental_ynn_fusion_type"
# Relative to XLA's default set of YNNPACK fusion kinds.
YNN_FUSION_TYPE = "-individual_convolution"


def set_defaults(ynn_fusion_type: str = YNN_FUSION_TYPE) -> None:
  """Adds YNN_OPTION=ynn_fusion_type to the XLA_FLAGS environment variable unless it sets
  that option to another value than this module's default (the user's value wins).

  A value equal to YNN_FUSION_TYPE, as a parent process that called this passes it on,
  is replaced. XLA_FLAGS that name a file (XLA reads flags from it when they do not
  start with '-') are left as they are. XLA reads XLA_FLAGS when JAX's backend starts
  (the first use of a device), so this must run before that; importing jax does not
  start it. ynn_fusion_type: XLA's syntax, kinds to drop from (-) or add to (+) its
  default set, comma separated.
  """
  flags = os.environ.get("XLA_FLAGS", "").strip()
  if flags and not flags.startswith("-"):
    return
  ours = f"{YNN_OPTION}={YNN_FUSION_TYPE}"
  words = [word for word in flags.split() if word != ours]
  if not any(re.match(re.escape(YNN_OPTION) + "(=|$)", word) for word in words):
    words.append(f"{YNN_OPTION}={ynn_fusion_type}")
  os.environ["XLA_FLAGS"] = " ".join(words)
