"""The encoder (and optionally its projection head) as an ONNX model, for ONNX Runtime and
the runtimes that read ONNX (TensorRT, Triton, OpenVINO).

The graph is built node by node with the onnx package's helpers from the encoder's
reference-layout state dict (state_dicts.to_state_dict) and computes this package's
forward pass: the ResNet of resnet.py under its config's padding rule (PADDINGS, each
'SAME' made explicit for the export's image size) and the ViT of vit.py. It is built here
rather than converted because no converter handles these models: jax2tf emits an
XlaCallModule op that tf2onnx cannot read, and jax2onnx requires an older orbax and
mis-lays the ResNet's BN outputs (docs/weights.md).

The model's input 'images' is uint8 [N, S, S, 3] (N dynamic; S the pretraining image
size), already centre-cropped and resized as the evaluation does (the ONNX metadata
names the crop); inside, the pixels are scaled to [0, 1] and standardised as
models.encode and the model do. Outputs: 'h' float32 [N, D] and, with a projection head,
'z' float32 [N, d] (its eval-mode output). Everything computes in float32, whatever the
config's compute dtype. Opset 17 (LayerNormalization; GELU as its erf formula).
"""

from typing import Dict, Optional

import flax
import jax
import numpy as np

from contrastive_jax import models
from contrastive_jax.models import common
from contrastive_jax.models import resnet
from contrastive_jax.models import vit

OPSET = 17
INPUT, H, Z = "images", "h", "z"
BN_EPSILON = 1e-5  # resnet.py's and heads.py's BatchNorm.


class _Graph:
  """Nodes and initialisers of one graph; each op's single output gets a fresh name."""

  def __init__(self):
    from onnx import helper  # The 'onnx' extra: imported only to export.
    from onnx import numpy_helper  # The 'onnx' extra: imported only to export.

    self._helper, self._numpy_helper = helper, numpy_helper
    self.nodes, self.initializers, self._count = [], [], 0

  def const(self, array, dtype=np.float32) -> str:
    name = f"const_{len(self.initializers)}"
    self.initializers.append(self._numpy_helper.from_array(np.asarray(array, dtype), name))
    return name

  def op(self, op_type: str, *inputs: str, output: Optional[str] = None, **attributes) -> str:
    self._count += 1
    output = output or f"{op_type.lower()}_{self._count}"
    self.nodes.append(self._helper.make_node(op_type, list(inputs), [output], **attributes))
    return output


def _explicit(padding, size: int, kernel: int, stride: int):
  """(before, after) pixels of a flax padding (an explicit [(b, a), (b, a)] or 'SAME', which
  pads max(0, (ceil(size / stride) - 1) * stride + kernel - size) split with the odd pixel
  after) on a size-pixel side."""
  if padding != "SAME":
    return tuple(padding[0])
  total = max(0, (-(-size // stride) - 1) * stride + kernel - size)
  return total // 2, total - total // 2


def _conv(
  g: _Graph,
  x: str,
  size: int,
  weight: np.ndarray,
  stride: int,
  padding,
  bias: Optional[np.ndarray] = None,
):
  """A [O, I, k, k] convolution of NCHW x on size x size pixels; returns (y, its size)."""
  kernel = weight.shape[-1]
  before, after = _explicit(padding, size, kernel, stride)
  inputs = [x, g.const(weight)] + ([] if bias is None else [g.const(bias)])
  y = g.op(
    "Conv",
    *inputs,
    kernel_shape=[kernel, kernel],
    strides=[stride, stride],
    pads=[before, before, after, after],
  )
  return y, (size + before + after - kernel) // stride + 1


def _bn(g: _Graph, x: str, scale, bias, mean, var) -> str:
  """Eval-mode BN of [N, C, ...] x: (x - mean) / sqrt(var + eps) * scale + bias."""
  return g.op(
    "BatchNormalization", x, *(g.const(v) for v in (scale, bias, mean, var)), epsilon=BN_EPSILON
  )


def _torch_bn(g: _Graph, x: str, tensors, name: str) -> str:
  return _bn(
    g, x, *(tensors[f"{name}.{k}"] for k in ("weight", "bias", "running_mean", "running_var"))
  )


def _pixels(g: _Graph, model_config) -> str:
  """uint8 NHWC images -> standardised float32 NCHW, as models.encode and the model do."""
  mean, std = (np.asarray(v, np.float32) for v in common.input_statistics(model_config))
  x = g.op("Div", g.op("Cast", INPUT, to=1), g.const(255.0))  # to=1: FLOAT.
  x = g.op("Div", g.op("Sub", x, g.const(mean)), g.const(std))
  return g.op("Transpose", x, perm=[0, 3, 1, 2])


def _resnet(g: _Graph, x: str, size: int, model_config, tensors) -> str:
  """resnet.ResNet's forward pass on NCHW x; returns h [N, C]."""
  block_type, stage_sizes = resnet.SPECS[model_config.name]
  rule = model_config.padding
  conv = lambda x, size, name, stride=1, stem=False: _conv(
    g,
    x,
    size,
    tensors[name],
    stride,
    resnet.conv_padding(tensors[name].shape[-1], stride, rule, stem),
  )
  if model_config.stem == "cifar":
    x, size = conv(x, size, "conv1.weight")
    x = g.op("Relu", _torch_bn(g, x, tensors, "bn1"))
  else:
    x, size = conv(x, size, "conv1.weight", 2, stem=True)
    x = g.op("Relu", _torch_bn(g, x, tensors, "bn1"))
    before, after = _explicit(resnet.max_pool_padding(rule), size, 3, 2)
    x = g.op(
      "MaxPool", x, kernel_shape=[3, 3], strides=[2, 2], pads=[before, before, after, after]
    )  # ONNX pads never win the max (-inf).
    size = (size + before + after - 3) // 2 + 1
  convs = 2 if block_type == "basic" else 3
  strided = 1 if block_type == "basic" else 2  # The conv that strides (torchvision v1.5).
  for stage, blocks in enumerate(stage_sizes):
    for j in range(blocks):
      name, stride = f"layer{stage + 1}.{j}", 2 if stage > 0 and j == 0 else 1
      y, y_size = x, size
      for c in range(1, convs + 1):
        y, y_size = conv(y, y_size, f"{name}.conv{c}.weight", stride if c == strided else 1)
        y = _torch_bn(g, y, tensors, f"{name}.bn{c}")
        if c < convs:
          y = g.op("Relu", y)
      if f"{name}.downsample.0.weight" in tensors:
        x, _ = conv(x, size, f"{name}.downsample.0.weight", stride)
        x = _torch_bn(g, x, tensors, f"{name}.downsample.1")
      x, size = g.op("Relu", g.op("Add", y, x)), y_size
  return g.op("Flatten", g.op("GlobalAveragePool", x), axis=1)


def _layer_norm(g: _Graph, x: str, tensors, name: str, epsilon: float = vit.LN_EPSILON) -> str:
  return g.op(
    "LayerNormalization",
    x,
    g.const(tensors[f"{name}.weight"]),
    g.const(tensors[f"{name}.bias"]),
    axis=-1,
    epsilon=epsilon,
  )


def _linear(g: _Graph, x: str, tensors, name: str) -> str:
  """A torch Linear ([out, in] weight) on [..., in] x."""
  y = g.op("MatMul", x, g.const(tensors[f"{name}.weight"].T))
  return g.op("Add", y, g.const(tensors[f"{name}.bias"]))


def _slice(g: _Graph, x: str, start: int, end: int, axis: int) -> str:
  """x[..., start:end, ...] on `axis`."""
  const = lambda v: g.const([v], np.int64)
  return g.op("Slice", x, const(start), const(end), const(axis))


def _tokens(g: _Graph, x: str, start: int, end: int) -> str:
  """Tokens start:end of x [N, T, D]."""
  return _slice(g, x, start, end, 1)


def _vit(g: _Graph, x: str, size: int, model_config, tensors) -> str:
  """vit.ViT's forward pass on NCHW x; returns h [N, D] (the class token after the last LN).
  DINOv2's options come from the state dict's tensors: register_tokens, ls1 / ls2 gammas,
  SwiGLU's mlp.w12 / mlp.w3; DINOv3's too (storage_tokens, each block's qkv.bias_mask
  applied to its bias), with the config's RoPE (_rope) and LayerNorm eps."""
  d, heads = models.encoder_width(model_config), vit.num_heads(model_config)
  p = model_config.patch_size
  epsilon = vit.config_field(model_config, "norm_epsilon")
  norm = lambda x, name: _layer_norm(g, x, tensors, name, epsilon)
  tensors = {
    name: value * tensors[name + "_mask"] if name + "_mask" in tensors else value
    for name, value in tensors.items()
  }  # DINOv3's masked key bias: bias * bias_mask.
  x, grid = _conv(
    g,
    x,
    size,
    tensors["patch_embed.proj.weight"],
    p,
    [(0, 0), (0, 0)],
    tensors["patch_embed.proj.bias"],
  )
  x = g.op(
    "Transpose", g.op("Reshape", x, g.const([0, d, grid * grid], np.int64)), perm=[0, 2, 1]
  )  # [N, T - 1, D], patches row-major as vit.py's reshape.
  batch = g.op("Slice", g.op("Shape", x), g.const([0], np.int64), g.const([1], np.int64))
  cls = g.op(
    "Expand",
    g.const(tensors["cls_token"]),
    g.op("Concat", batch, g.const([1, d], np.int64), axis=0),
  )
  x = g.op("Concat", cls, x, axis=1)
  rope = vit.config_field(model_config, "position_embedding") == "rope"
  if not rope:
    # pos_embed: learned (resized to this grid as vit.py resizes it), or the sin-cos table
    # with the class token's row zero (state_dicts).
    pos_embed = vit.interpolate_position_embedding(
      tensors["pos_embed"], grid, vit.config_field(model_config, "position_interpolation")
    )
    x = g.op("Add", x, g.const(np.asarray(pos_embed, np.float32)))
  registers = tensors.get("storage_tokens" if rope else "register_tokens")
  if registers is not None:  # Between the class token and the patches, no position.
    registers = g.op(
      "Expand",
      g.const(registers),
      g.op("Concat", batch, g.const(list(registers.shape[1:]), np.int64), axis=0),
    )
    x = g.op("Concat", _tokens(g, x, 0, 1), registers, _tokens(g, x, 1, grid * grid + 1), axis=1)
  scaled = lambda y, gamma: g.op("Mul", y, g.const(tensors[gamma])) if gamma in tensors else y
  head_dim = d // heads
  for i in range(model_config.depth):
    name = f"blocks.{i}"
    qkv = _linear(g, norm(x, f"{name}.norm1"), tensors, f"{name}.attn.qkv")
    qkv = g.op(
      "Transpose",
      g.op("Reshape", qkv, g.const([0, 0, 3, heads, head_dim], np.int64)),
      perm=[2, 0, 3, 1, 4],
    )  # [3, N, heads, T, head_dim]
    q, k, v = (g.op("Gather", qkv, g.const(j, np.int64), axis=0) for j in range(3))
    if rope:
      prefix = 1 + (0 if registers is None else tensors["storage_tokens"].shape[1])
      q, k = (_rope(g, y, prefix, grid, head_dim) for y in (q, k))
    logits = g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2]))
    weights = g.op("Softmax", g.op("Div", logits, g.const(head_dim**0.5)), axis=-1)
    out = g.op("Transpose", g.op("MatMul", weights, v), perm=[0, 2, 1, 3])
    out = g.op("Reshape", out, g.const([0, 0, d], np.int64))
    x = g.op("Add", x, scaled(_linear(g, out, tensors, f"{name}.attn.proj"), f"{name}.ls1.gamma"))
    y = norm(x, f"{name}.norm2")
    if f"{name}.mlp.w12.weight" in tensors:  # SwiGLU: w3(silu(a) * b), [a, b] = w12(y).
      y = _linear(g, y, tensors, f"{name}.mlp.w12")
      hidden = tensors[f"{name}.mlp.w3.weight"].shape[1]
      a, b = (_slice(g, y, start, start + hidden, 2) for start in (0, hidden))
      y = _linear(g, g.op("Mul", g.op("Mul", a, g.op("Sigmoid", a)), b), tensors, f"{name}.mlp.w3")
    else:
      y = _linear(g, y, tensors, f"{name}.mlp.fc1")
      # Exact GELU, y * (1 + erf(y / sqrt(2))) / 2 (vit.py: approximate=False).
      y = g.op(
        "Mul",
        g.op("Mul", y, g.const(0.5)),
        g.op("Add", g.const(1.0), g.op("Erf", g.op("Div", y, g.const(2.0**0.5)))),
      )
      y = _linear(g, y, tensors, f"{name}.mlp.fc2")
    x = g.op("Add", x, scaled(y, f"{name}.ls2.gamma"))
  x = norm(x, "norm")
  return g.op("Gather", x, g.const(0, np.int64), axis=1)


def _rope(g: _Graph, x: str, prefix: int, grid: int, head_dim: int) -> str:
  """vit.apply_rope on x [N, heads, prefix + grid^2, head_dim]: the last grid^2 tokens rotated
  by vit.rope_sin_cos's tables, the prefix (class and storage tokens) kept."""
  sin, cos = vit.rope_sin_cos(grid, head_dim)
  end, half = prefix + grid * grid, head_dim // 2
  patches = _slice(g, x, prefix, end, 2)
  rotated = g.op(
    "Concat",
    g.op("Neg", _slice(g, patches, half, head_dim, 3)),
    _slice(g, patches, 0, half, 3),
    axis=3,
  )
  patches = g.op("Add", g.op("Mul", patches, g.const(cos)), g.op("Mul", rotated, g.const(sin)))
  return g.op("Concat", _slice(g, x, 0, prefix, 2), patches, axis=2)


# models.FAMILIES key -> the encoder's forward pass, (g, NCHW x, S, model_config, state dict)
# -> h.
_FORWARD = {"resnet": _resnet, "vit": _vit}


def _projection(g: _Graph, h: str, module, variables) -> str:
  """heads.MLP's eval-mode forward pass on h [N, D]; module: the MLP, variables its
  {'params', 'batch_stats'}."""
  params, stats = variables["params"], variables.get("batch_stats", {})
  dense = iter(range(len(module.hidden_dims) + 1))
  norm = iter(range(len(module.hidden_dims) + 1))

  def linear(x):
    layer = params[f"Dense_{next(dense)}"]
    x = g.op("MatMul", x, g.const(layer["kernel"]))
    return g.op("Add", x, g.const(layer["bias"])) if "bias" in layer else x

  def bn(x):
    name = f"BatchNorm_{next(norm)}"
    width = stats[name]["mean"].shape[0]
    affine = params.get(name, {})  # MoCo v3's last BN has neither scale nor bias: no params.
    return _bn(
      g,
      x,
      affine.get("scale", np.ones(width)),
      affine.get("bias", np.zeros(width)),
      stats[name]["mean"],
      stats[name]["var"],
    )

  x = h
  for _ in module.hidden_dims:
    x = linear(x)
    x = g.op("Relu", bn(x) if module.use_bn else x)
  x = linear(x)
  return bn(x) if module.final_bn else x


def build(
  model_config,
  tensors: Dict[str, np.ndarray],
  image_size: int,
  projector=None,
  metadata: Optional[Dict[str, str]] = None,
):
  """The onnx.ModelProto of the encoder (see the module docstring), checked by onnx.checker.

  Args:
    model_config: the encoder's model config (models.build_encoder's).
    tensors: its state dict, state_dicts.to_state_dict(model_config, variables, image_size).
    image_size: S, the side of the input images in pixels.
    projector: None, or (heads.MLP module, its {'params', 'batch_stats'}) to output 'z' too.
    metadata: strings stored as the model's metadata_props (the eval crop, the source).
  Raises:
    ImportError: the onnx package is not installed (the 'onnx' extra).
  """
  from onnx import TensorProto
  from onnx import checker
  from onnx import helper

  g = _Graph()
  x = _pixels(g, model_config)
  forward = _FORWARD[models.family(model_config)]
  h = g.op("Identity", forward(g, x, image_size, model_config, tensors), output=H)
  outputs = [
    helper.make_tensor_value_info(
      H, TensorProto.FLOAT, ["batch", models.encoder_width(model_config)]
    )
  ]
  if projector is not None:
    module, variables = projector
    variables = jax.tree.map(np.asarray, flax.core.unfreeze(variables))
    g.op("Identity", _projection(g, h, module, variables), output=Z)
    outputs.append(helper.make_tensor_value_info(Z, TensorProto.FLOAT, ["batch", module.out_dim]))
  graph = helper.make_graph(
    g.nodes,
    "contrastive_jax_encoder",
    [helper.make_tensor_value_info(INPUT, TensorProto.UINT8, ["batch", image_size, image_size, 3])],
    outputs,
    g.initializers,
  )
  model = helper.make_model(
    graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="contrastive_jax"
  )
  model.ir_version = 8  # The IR of opset 17 (ONNX 1.12): older runtimes read it too.
  helper.set_model_props(model, metadata or {})
  checker.check_model(model)
  return model
