"""Model FLOPs of a JAX function, counted from its jaxpr: the same figure on every backend.

XLA's cost analysis of a compiled program leaves out what a backend hands to libraries (the
GPU backend's convolutions are cuDNN calls: the H200's compiled ResNet-18 step reported 1% of
its FLOPs), and JAX 0.11 gives no cost analysis of a lowered program on GPUs. MFU wants the
FLOPs the model asks for, whatever runs them, so this counts the matrix work in the traced
program: 2 per multiply-add of every dot and convolution, forward and backward alike (the
convention of MFU in Chowdhery et al. 2022, PaLM, appendix B). Elementwise work is left out:
it is a small share of a ResNet or ViT step and bound by memory, not by the peak.
"""

import math

import jax

# Primitives whose sub-programs run once per trip of a loop of known length.
_LOOP_LENGTH = {"scan": lambda params: params["length"]}


def _dot_flops(eqn) -> float:
  """2 x (output elements) x (contracted size) of a dot_general."""
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs_shape = eqn.invars[0].aval.shape
  contracted = math.prod(lhs_shape[d] for d in lhs_contract)
  return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted


def _conv_flops(eqn) -> float:
  """2 x (output elements) x (multiply-adds per output element) of a conv_general_dilated:
  the kernel's input features times its window (its size over its output features), over the
  input's dilation (a strided convolution's input gradient dilates its input with zeros,
  which multiply nothing)."""
  kernel_shape = eqn.invars[1].aval.shape
  out_features = kernel_shape[eqn.params["dimension_numbers"].rhs_spec[0]]
  per_output = math.prod(kernel_shape) / out_features / math.prod(eqn.params["lhs_dilation"])
  return 2.0 * math.prod(eqn.outvars[0].aval.shape) * per_output


def _sub_jaxprs(value):
  """The jaxprs inside an equation's parameter (a jaxpr, a closed jaxpr or a tuple of them)."""
  if hasattr(value, "eqns"):
    yield value
  elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _sub_jaxprs(item)


def jaxpr_flops(jaxpr) -> float:
  """The dot and convolution FLOPs of a jaxpr, sub-programs included: a scan's body times its
  length, a cond's costliest branch, a shard_map's body (per-device shapes) times its mesh's
  devices (a while loop's body once: its trip count is unknown), so the result is the whole
  program's over all devices."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      total += _dot_flops(eqn)
    elif name == "conv_general_dilated":
      total += _conv_flops(eqn)
    subs = [sub for value in eqn.params.values() for sub in _sub_jaxprs(value)]
    if not subs:
      continue
    if name == "cond":
      total += max(jaxpr_flops(sub) for sub in subs)
      continue
    times = _LOOP_LENGTH[name](eqn.params) if name in _LOOP_LENGTH else 1
    if name == "shard_map":
      times = eqn.params["mesh"].size
    total += times * sum(jaxpr_flops(sub) for sub in subs)
  return total


def model_flops(fn, *args) -> float:
  """FLOPs of fn(*args) over all devices: 2 per multiply-add of its dots and convolutions
  (jaxpr_flops). args may be arrays or jax.ShapeDtypeStruct; nothing runs."""
  return jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)
