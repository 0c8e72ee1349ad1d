"""Encoder variables <-> PyTorch state dicts: torchvision's ResNet, timm's and MoCo v3's ViT.

A state dict here is {name: float32 numpy array} in the reference's names and
layouts: torchvision resnet.py's ResNet (conv1, bn1, layer1.0.conv1, ...,
downsample.0/1; BN running statistics and num_batches_tracked) and timm
vision_transformer.py's VisionTransformer, which MoCo v3's vits.py subclasses
(patch_embed.proj, cls_token, pos_embed, blocks.i.{norm1, attn.qkv, attn.proj,
norm2, mlp.fc1, mlp.fc2}, norm), with DINOv2's tensors where the model has them
(register_tokens, mask_token, blocks.i.ls1.gamma / ls2.gamma, SwiGLU's mlp.w12 / mlp.w3;
timm's names for them read too: _vit_reference_names), and a DINOv3 ViT's (dinov3
vision_transformer.py: storage_tokens, rope_embed.periods, blocks.i.attn.qkv.bias_mask, no
pos_embed; timm's eva.py names read too). Convolution weights are [O, I, kh, kw] there
and [kh, kw, I, O] here; Linear weights [out, in] there, [in, out] here.

The encoder has no classifier: a stock model loads an exported dict with
load_state_dict(strict=True) once its classifier is removed
(torchvision: model.fc = torch.nn.Identity(); timm: num_classes=0), and the
classifier or projection head a file holds (fc.*, head.*, fc_norm.*) is left
out on import. A MoCo v3 ViT's fixed position embedding is a tensor of its
state dict (pos_embed, the class token's row zero); it is written so and must
equal this package's on import.
"""

from typing import Callable, Dict, List, NamedTuple

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from contrastive_jax import models
from contrastive_jax.core.errors import WeightsError
from contrastive_jax.models import resnet
from contrastive_jax.models import vit

# Prefixes under which checkpoints keep their encoder, tried in this order: MoCo v3
# (builder.py: base_encoder, momentum_encoder), MoCo v1/v2 (encoder_q, encoder_k), DINO
# (main_dino.py's MultiCropWrapper: backbone, head), each saved from
# DistributedDataParallel ('module.') or not, then any DataParallel or bare one.
ENCODER_PREFIXES = (
  "module.base_encoder.",
  "module.encoder_q.",
  "module.backbone.",
  "base_encoder.",
  "encoder_q.",
  "backbone.",
  "module.",
  "",
)


class Entry(NamedTuple):
  """One tensor: its torch name, where it lives in the variables, and how it is laid out.

  collection: 'params' or 'batch_stats'; path: the key path in it; layout: 'conv'
  ([O, I, kh, kw] <-> [kh, kw, I, O]), 'dense' ([out, in] <-> [in, out]) or 'same';
  'fixed' for a tensor that is not a variable but a function of the config (a ViT's sin-cos
  pos_embed, DINOv3's rope_embed.periods and bias_mask: fixed_tensor); 'counter' for a BN's
  num_batches_tracked (written as 0, ignored on import); 'unused' for DINOv2's mask_token
  (written as zeros, optional and ignored on import).
  """

  name: str
  collection: str
  path: tuple
  layout: str


# DINOv2 state dicts (dinov2 vision_transformer.py DinoVisionTransformer) hold mask_token
# [1, D], used only by masked-image pretraining: left out on import, written as zeros on
# export (layout 'unused') so that the reference loads the export strictly.
MASK_TOKEN = "mask_token"
# Tensors that only a DINOv3 ViT (dinov3 vision_transformer.py: RoPE, storage tokens) holds.
DINOV3_TENSORS = ("storage_tokens", "rope_embed.periods")
# DINOv3's buffer of each block's qkv (LinearKMaskedBias): 1 on the query and value thirds
# of the bias, 0 on the key third.
BIAS_MASK = ".attn.qkv.bias_mask"


def variable_shapes(model_config, image_size: int):
  """The encoder's {'params', 'batch_stats'} as ShapeDtypeStructs, for images of image_size
  (a new tree each call)."""
  key = (ml_collections.ConfigDict(model_config).to_json_best_effort(sort_keys=True), image_size)
  if key not in _SHAPES:
    while len(_SHAPES) >= _KEPT_SHAPES:
      _SHAPES.pop(next(iter(_SHAPES)))
    encoder = models.build_encoder(model_config)
    x = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)
    shapes = jax.eval_shape(lambda x: encoder.init(jax.random.PRNGKey(0), x, train=False), x)
    _SHAPES[key] = {"params": shapes["params"], "batch_stats": shapes.get("batch_stats", {})}
  return jax.tree.map(lambda leaf: leaf, _SHAPES[key])


# variable_shapes' trees of the last few (model config, image size) of this process: tracing
# the initialiser of a ViT-S takes about a second of CPU, and importing or exporting a file
# reads the shapes of the same model more than once (entries, the shape checks).
_SHAPES = {}
_KEPT_SHAPES = 16


def _bn(name: str, module: tuple) -> List[Entry]:
  return [
    Entry(f"{name}.weight", "params", module + ("scale",), "same"),
    Entry(f"{name}.bias", "params", module + ("bias",), "same"),
    Entry(f"{name}.running_mean", "batch_stats", module + ("mean",), "same"),
    Entry(f"{name}.running_var", "batch_stats", module + ("var",), "same"),
    Entry(f"{name}.num_batches_tracked", "", (), "counter"),
  ]


def _resnet_entries(model_config, params) -> List[Entry]:
  block_type, stage_sizes = resnet.SPECS[model_config.name]
  prefix = "BasicBlock_" if block_type == "basic" else "BottleneckBlock_"
  convs = 2 if block_type == "basic" else 3
  entries = [
    Entry("conv1.weight", "params", ("stem_conv", "kernel"), "conv"),
    *_bn("bn1", ("stem_bn",)),
  ]
  k = 0
  for stage, blocks in enumerate(stage_sizes):
    for j in range(blocks):
      block, name = f"{prefix}{k}", f"layer{stage + 1}.{j}"
      for c in range(convs):
        entries.append(
          Entry(f"{name}.conv{c + 1}.weight", "params", (block, f"Conv_{c}", "kernel"), "conv")
        )
        entries += _bn(f"{name}.bn{c + 1}", (block, f"BatchNorm_{c}"))
      if f"Conv_{convs}" in params[block]:  # The projection shortcut.
        entries.append(
          Entry(f"{name}.downsample.0.weight", "params", (block, f"Conv_{convs}", "kernel"), "conv")
        )
        entries += _bn(f"{name}.downsample.1", (block, f"BatchNorm_{convs}"))
      k += 1
  return entries


def _vit_entries(model_config, params) -> List[Entry]:
  patch = [name for name in params if name.endswith("patch_embed")][0]
  learned = "pos_embed" in params
  rope = vit.config_field(model_config, "position_embedding") == "rope"
  entries = [Entry("cls_token", "params", ("cls_token",), "same")]
  if not rope:
    entries.append(
      Entry(
        "pos_embed",
        "params" if learned else "",
        ("pos_embed",) if learned else (),
        "same" if learned else "fixed",
      )
    )
  if "register_tokens" in params:
    name = "storage_tokens" if rope else "register_tokens"
    entries.append(Entry(name, "params", ("register_tokens",), "same"))
  if "ls1" in params["block0"]:  # DINOv2's and DINOv3's layout.
    entries.append(Entry(MASK_TOKEN, "", (), "unused"))
  entries += [
    Entry("patch_embed.proj.weight", "params", (patch, "kernel"), "conv"),
    Entry("patch_embed.proj.bias", "params", (patch, "bias"), "same"),
  ]
  if rope:
    entries.append(Entry("rope_embed.periods", "", (), "fixed"))
  swiglu = "w12" in params["block0"]
  for i in range(model_config.depth):
    block, name = f"block{i}", f"blocks.{i}"
    for ours, theirs in (("norm1", "norm1"), ("norm2", "norm2")):
      entries += [
        Entry(f"{name}.{theirs}.weight", "params", (block, ours, "scale"), "same"),
        Entry(f"{name}.{theirs}.bias", "params", (block, ours, "bias"), "same"),
      ]
    entries += [
      Entry(f"{name}.{scale}.gamma", "params", (block, scale), "same")
      for scale in ("ls1", "ls2")
      if scale in params[block]
    ]
    if vit.config_field(model_config, "mask_key_bias"):
      entries.append(Entry(name + BIAS_MASK, "", (), "fixed"))
    for ours, theirs in (
      (("attn", "qkv"), "attn.qkv"),
      (("attn", "proj"), "attn.proj"),
      *(
        ((("w12",), "mlp.w12"), (("w3",), "mlp.w3"))
        if swiglu
        else ((("fc1",), "mlp.fc1"), (("fc2",), "mlp.fc2"))
      ),
    ):
      entries += [
        Entry(f"{name}.{theirs}.weight", "params", (block, *ours, "kernel"), "dense"),
        Entry(f"{name}.{theirs}.bias", "params", (block, *ours, "bias"), "same"),
      ]
  entries += [
    Entry("norm.weight", "params", ("norm", "scale"), "same"),
    Entry("norm.bias", "params", ("norm", "bias"), "same"),
  ]
  return entries


def _vit_reference_names(found: Dict[str, np.ndarray], model_config) -> Dict[str, np.ndarray]:
  """A ViT's tensors in timm's names in the reference's. DINOv2 (timm vision_transformer.py's
  _convert_dinov2 made them from DINOv2's): reg_token -> register_tokens, and pos_embed
  without the class token's row (timm's no_embed_class, where the class token holds the
  reference's cls_token + pos_embed[:, 0]) given a zero row, which adds the same; a SwiGLU
  model's mlp.fc1 / mlp.fc2 -> mlp.w12 / mlp.w3. DINOv3 (timm eva.py's Eva, recognised by
  its blocks' gamma_1): _dinov3_reference_names. Other names are kept."""
  out = dict(found)
  if "blocks.0.gamma_1" in out:
    return _dinov3_reference_names(out, model_config)
  if "reg_token" in out:
    out["register_tokens"] = out.pop("reg_token")
    pos = out.get("pos_embed")
    if pos is not None and pos.ndim == 3 and round(pos.shape[1] ** 0.5) ** 2 == pos.shape[1]:
      out["pos_embed"] = np.concatenate([np.zeros_like(pos[:, :1]), pos], axis=1)
  if vit.config_field(model_config, "mlp") == "swiglu":
    renames = {".mlp.fc1.": ".mlp.w12.", ".mlp.fc2.": ".mlp.w3."}
    out = {
      next((name.replace(a, b) for a, b in renames.items() if a in name), name): value
      for name, value in out.items()
    }
  return out


def _dinov3_reference_names(found: Dict[str, np.ndarray], model_config) -> Dict[str, np.ndarray]:
  """A DINOv3 ViT's tensors in timm's names (eva.py checkpoint_filter_fn made them from
  DINOv3's) in the reference's: reg_token -> storage_tokens, blocks.i.gamma_1 / gamma_2 ->
  ls1.gamma / ls2.gamma, attn.q_bias and attn.v_bias -> attn.qkv.bias with the key third 0
  (timm drops it, held at 0 by the mask), or a zero qkv.bias for timm's models without one
  (vit_*_patch16_dinov3: the same function). The buffers timm drops, rope_embed.periods and
  each block's bias_mask, are added as the config computes them (fixed_tensor) when it is a
  RoPE ViT with the masked key bias."""
  out = {}
  for name, value in found.items():
    name = name.replace(".gamma_1", ".ls1.gamma").replace(".gamma_2", ".ls2.gamma")
    out["storage_tokens" if name == "reg_token" else name] = value
  blocks = sorted({name.split(".")[1] for name in out if name.startswith("blocks.")}, key=int)
  for i in blocks:
    prefix = f"blocks.{i}.attn."
    weight = out.get(prefix + "qkv.weight")
    q, v = out.pop(prefix + "q_bias", None), out.pop(prefix + "v_bias", None)
    if weight is None or prefix + "qkv.bias" in out:
      continue
    zeros = np.zeros(weight.shape[0] // 3, np.float32)
    q, v = (zeros if b is None else np.asarray(b, np.float32) for b in (q, v))
    out[prefix + "qkv.bias"] = np.concatenate([q, zeros, v])
  if vit.config_field(model_config, "position_embedding") == "rope":
    out.setdefault("rope_embed.periods", fixed_tensor("rope_embed.periods", model_config, 0))
    if vit.config_field(model_config, "mask_key_bias"):
      for i in blocks:
        name = f"blocks.{i}{BIAS_MASK}"
        out.setdefault(name, fixed_tensor(name, model_config, 0))
  return out


def _describe_resnet(model_config) -> str:
  return f"{model_config.name} (width {model_config.width}, stem {model_config.stem!r})"


def _describe_vit(model_config) -> str:
  field = lambda name: vit.config_field(model_config, name)
  rope = (
    f", position_embedding 'rope', mask_key_bias {field('mask_key_bias')}"
    if field("position_embedding") == "rope"
    else ""
  )
  return (
    f"{model_config.name} (D {models.encoder_width(model_config)}, depth "
    f"{model_config.depth}, patch {model_config.patch_size}, registers {field('registers')}, "
    f"layer_scale {field('layer_scale')}, mlp {field('mlp')!r}{rope})"
  )


class _Layout(NamedTuple):
  """A model family's state dict: its name in messages, its first tensor, the prefixes of a
  stock model's classifier and a self-supervised checkpoint's projection head (not
  encoder), its entries (model_config, params) -> [Entry] and a config's description."""

  label: str
  first_tensor: str
  head_prefixes: tuple
  entries: Callable
  describe: Callable
  reference_names: Callable = lambda found, model_config: found
  mismatch: Callable = None


# models.FAMILIES key -> its layout.
_LAYOUTS = {
  "resnet": _Layout("ResNet", "conv1.weight", ("fc.",), _resnet_entries, _describe_resnet),
  "vit": _Layout(
    "ViT",
    "patch_embed.proj.weight",
    # local_cls_norm: the DINOv3 ViT-L SAT493M file's norm of local crops' class tokens, used
    # only in its pretraining (dinov3 vision_transformer.py untie_global_and_local_cls_norm).
    ("head.", "fc_norm.", "local_cls_norm."),
    _vit_entries,
    _describe_vit,
    _vit_reference_names,
  ),
}


def entries(model_config, image_size: int) -> List[Entry]:
  """The encoder's tensors in the reference's order (see Entry)."""
  params = variable_shapes(model_config, image_size)["params"]
  return _LAYOUTS[models.family(model_config)].entries(model_config, params)


def torch_shapes(model_config, image_size: int) -> List[tuple]:
  """[(Entry, shape in the reference's layout)] of the encoder's tensors that are not fixed
  (a sin-cos pos_embed) or BN counters, in the reference's order; mask_token [1, D]."""
  params = variable_shapes(model_config, image_size)
  params = {c: flax.traverse_util.flatten_dict(params[c]) for c in params}
  return [
    (
      entry,
      (1, models.encoder_width(model_config))
      if entry.layout == "unused"
      else _torch_shape(params[entry.collection][entry.path].shape, entry.layout),
    )
    for entry in entries(model_config, image_size)
    if entry.layout not in ("fixed", "counter")
  ]


def _to_torch(array: np.ndarray, layout: str) -> np.ndarray:
  if layout == "conv":
    return array.transpose(3, 2, 0, 1)
  return array.T if layout == "dense" else array


def _torch_shape(shape: tuple, layout: str) -> tuple:
  if layout == "conv":
    return tuple(shape[i] for i in (3, 2, 0, 1))
  return tuple(reversed(shape)) if layout == "dense" else tuple(shape)


def _from_torch(array: np.ndarray, layout: str) -> np.ndarray:
  if layout == "conv":
    return array.transpose(2, 3, 1, 0)
  return array.T if layout == "dense" else array


def fixed_position_embedding(model_config, image_size: int) -> np.ndarray:
  """MoCo v3's pos_embed of a sin-cos ViT: float32 [1, 1 + grid^2, D], the class token's row 0."""
  grid, d = image_size // model_config.patch_size, models.encoder_width(model_config)
  table = vit.sincos_position_embedding(grid, d)
  return np.concatenate([np.zeros((1, d), np.float32), table])[None]


def fixed_tensor(name: str, model_config, image_size: int) -> np.ndarray:
  """The value of a 'fixed' entry, float32: pos_embed (fixed_position_embedding, for
  image_size), DINOv3's rope_embed.periods (vit.rope_periods of a head's width) or a block's
  bias_mask [3D] (1, 0, 1 on the query, key and value thirds)."""
  d = models.encoder_width(model_config)
  if name == "rope_embed.periods":
    return vit.rope_periods(d // vit.num_heads(model_config))
  if name.endswith(BIAS_MASK):
    return np.concatenate([np.ones(d), np.zeros(d), np.ones(d)]).astype(np.float32)
  return fixed_position_embedding(model_config, image_size)


def _fixed_refusal(name: str, model_config, image_size: int, describe: str, diff: str) -> str:
  """Why a file's fixed tensor `name` is refused: it is not the config's (diff says how)."""
  if name == "rope_embed.periods":
    return (
      f"rope_embed.periods are not the RoPE periods of base {vit.ROPE_BASE:g} of a {describe} "
      f"({diff}): another RoPE than DINOv3's ViTs'"
    )
  if name.endswith(BIAS_MASK):
    return f"{name} is not DINOv3's key-bias mask (1, 0, 1 on the thirds; {diff})"
  return (
    f"pos_embed is not the fixed 2-D sin-cos embedding of a {describe} on {image_size} px "
    f"images ({diff}): a learned one needs --config.model.position_embedding=learned"
  )


def to_state_dict(model_config, variables, image_size: int) -> Dict[str, np.ndarray]:
  """The encoder's variables as the reference's state dict (float32; num_batches_tracked int64 0).

  variables: {'params', 'batch_stats'} of models.build_encoder(model_config).
  """
  flat = {
    collection: flax.traverse_util.flatten_dict(jax.device_get(variables.get(collection, {})))
    for collection in ("params", "batch_stats")
  }
  out = {}
  for entry in entries(model_config, image_size):
    if entry.layout == "counter":
      out[entry.name] = np.zeros((), np.int64)
    elif entry.layout == "unused":
      out[entry.name] = np.zeros((1, models.encoder_width(model_config)), np.float32)
    elif entry.layout == "fixed":
      out[entry.name] = fixed_tensor(entry.name, model_config, image_size)
    else:
      out[entry.name] = np.ascontiguousarray(
        _to_torch(np.asarray(flat[entry.collection][entry.path], np.float32), entry.layout)
      )
  return out


def encoder_tensors(
  tensors: Dict[str, np.ndarray], path: str, model_config
) -> Dict[str, np.ndarray]:
  """The encoder's tensors of a file: under the first of ENCODER_PREFIXES that holds the
  model family's first tensor, that prefix removed, classifier and projection heads and BN
  counters left out, in the reference's names (timm's DINOv2 names mapped:
  _vit_reference_names).

  Raises:
    WeightsError: no prefix holds the family's first tensor (naming another family when
      the file holds its weights, else the file's first key).
  """
  layout = _LAYOUTS[models.family(model_config)]
  first = layout.first_tensor
  prefix = next((p for p in ENCODER_PREFIXES if p + first in tensors), None)
  if prefix is None:
    found = next(
      (
        f"it holds a {other.label} ({p + other.first_tensor})"
        for other in _LAYOUTS.values()
        if other is not layout
        for p in ENCODER_PREFIXES
        if p + other.first_tensor in tensors
      ),
      None,
    )
    what = found or f"its first tensor is {next(iter(sorted(tensors)), '(none)')!r}"
    raise WeightsError(
      path,
      f"not the weights of a {layout.describe(model_config)}: no {first!r} "
      f"under any of the prefixes {[p for p in ENCODER_PREFIXES if p]} or "
      f"none; {what}",
    )
  heads = layout.head_prefixes
  found = {
    name[len(prefix) :]: value
    for name, value in tensors.items()
    if name.startswith(prefix)
    and not name[len(prefix) :].startswith(heads)
    and not name.endswith("num_batches_tracked")
  }
  return layout.reference_names(found, model_config)


def _vit_mismatch(
  model_config, names: List[str], found: Dict[str, np.ndarray], missing: bool
) -> str:
  """Why a ViT file's tensors named so (missing from it when `missing`, else extra in it) do
  not fit the config: a DINOv3 file for another ViT or the reverse (naming the tensors that
  tell, with their shapes), register tokens, layer scale, the masked key bias or the SwiGLU
  MLP (naming the config field to set), or another architecture or depth."""
  shapes = lambda tensors: ", ".join(f"{n} {list(np.shape(found[n]))}" for n in tensors)
  rope = vit.config_field(model_config, "position_embedding") == "rope"
  dinov3 = [name for name in DINOV3_TENSORS if name in found]
  if dinov3 and not rope:
    return (
      f"it holds a DINOv3 ViT ({shapes(dinov3)}: RoPE and storage tokens), not this ViT: "
      "configs/dinov3.py describes DINOv3's"
    )
  if rope and "pos_embed" in found:
    return (
      f"it holds a ViT with a learned position embedding ({shapes(['pos_embed'])}; DINOv2's "
      "or timm's), not a DINOv3 ViT (RoPE, no pos_embed): configs/dinov2.py describes DINOv2's"
    )
  if all(name.endswith(BIAS_MASK) for name in names):
    return f"the file's ViT {'does not mask' if missing else 'masks'} its key bias: " + (
      f"--config.model.mask_key_bias={not missing}"
    )
  for tokens in ("register_tokens", "storage_tokens"):
    if tokens in names:
      count = found[tokens].shape[1] if not missing else 0
      return f"the file's ViT has {count} {tokens.replace('_', ' ')}: " + (
        f"--config.model.registers={count}"
      )
  if any(name.endswith((".ls1.gamma", ".ls2.gamma")) for name in names):
    return f"the file's ViT has{' no' if missing else ''} layer scale: " + (
      f"--config.model.layer_scale={not missing}"
    )
  if any(".mlp.w12." in name or ".mlp.w3." in name for name in [*names, *found]):
    return "the file's ViT has SwiGLU (mlp.w12, mlp.w3): --config.model.mlp=swiglu"
  return "another architecture or depth"


def _mismatch(names: List[str], stage_projection: str) -> str:
  """Why tensors named so do not fit: only layer1.0's projection shortcut (a ResNet-10/18/34 with
  or without model.stage_projection, resnet.py) or another architecture."""
  if all(name.startswith("layer1.0.downsample.") for name in names):
    return (
      "the file's ResNet has the same depth but "
      + ("no" if stage_projection == "False" else "a")
      + " projection shortcut in its first block (torchvision's has none, SimCLR's and "
      f"BYOL's have one): --config.model.stage_projection={stage_projection}"
    )
  return "another architecture or depth"


def from_state_dict(
  tensors: Dict[str, np.ndarray], path: str, model_config, image_size: int
) -> dict:
  """The encoder's {'params', 'batch_stats'} (float32 numpy) from a file's named tensors.

  tensors: as tensor_files.read gives them, in torch names, with any of
  ENCODER_PREFIXES. The encoder's tensors must be exactly the model's.

  Raises:
    WeightsError: see encoder_tensors; a tensor the model has and the file
      lacks, or the file has and the model lacks (the first one named); a
      shape that differs (named with both shapes); a fixed pos_embed that is
      not this package's sin-cos embedding.
  """
  found = encoder_tensors(tensors, path, model_config)
  shapes = variable_shapes(model_config, image_size)
  shapes = {c: flax.traverse_util.flatten_dict(shapes[c]) for c in shapes}
  every = entries(model_config, image_size)
  names = {e.name for e in every}
  expected = [e for e in every if e.layout not in ("counter", "unused")]
  describe = _LAYOUTS[models.family(model_config)].describe(model_config)
  vit_family = models.family(model_config) == "vit"
  why = lambda names, missing: (
    _vit_mismatch(model_config, names, found, missing)
    if vit_family
    else _mismatch(names, "False" if missing else "True")
  )
  missing = [e.name for e in expected if e.name not in found]
  if missing:
    raise WeightsError(
      path,
      f"has no tensor {missing[0]!r} ({len(missing)} of the "
      f"{len(expected)} tensors of a {describe} are missing): " + why(missing, True),
    )
  unexpected = sorted(name for name in found if name not in names)
  if unexpected:
    raise WeightsError(
      path,
      f"has a tensor {unexpected[0]!r} that a {describe} does not have "
      f"({len(unexpected)} such): " + why(unexpected, False),
    )
  flat = {"params": {}, "batch_stats": {}}
  for entry in expected:
    value = np.asarray(found[entry.name], np.float32)
    if entry.layout == "fixed":
      want = fixed_tensor(entry.name, model_config, image_size)
      if value.shape != want.shape or not np.allclose(value, want, rtol=1e-5, atol=1e-5):
        diff = (
          f"max difference {np.max(np.abs(value - want)):.3g}"
          if value.shape == want.shape
          else f"shape {list(value.shape)} where it needs {list(want.shape)}"
        )
        raise WeightsError(
          path, _fixed_refusal(entry.name, model_config, image_size, describe, diff)
        )
      continue
    want = _torch_shape(shapes[entry.collection][entry.path].shape, entry.layout)
    if value.shape != want:
      raise WeightsError(
        path,
        f"tensor {entry.name!r} has shape {list(value.shape)} where a "
        f"{describe} on {image_size} px images needs {list(want)}"
        + _more_misfits(expected, found, shapes, entry),
      )
    flat[entry.collection][entry.path] = _from_torch(value, entry.layout)
  return {c: flax.traverse_util.unflatten_dict(flat[c]) for c in flat}


def _more_misfits(expected: List[Entry], found, shapes, first: Entry) -> str:
  """'' or how many of the tensors after `first` in `expected` have other shapes than the
  model's, the next two named with both shapes (a file of another size)."""
  after = expected[expected.index(first) + 1 :]
  misfits = [
    (e.name, list(np.shape(found[e.name])), list(want))
    for e in after
    if e.layout != "fixed"
    and np.shape(found[e.name])
    != (want := _torch_shape(shapes[e.collection][e.path].shape, e.layout))
  ]
  if not misfits:
    return ""
  named = ", ".join(f"{name!r} {got} for {want}" for name, got, want in misfits[:2])
  return f" (and {len(misfits)} more of other shapes: {named}{', ...' if len(misfits) > 2 else ''})"


def _dino_head_entries(head) -> List[Entry]:
  """The tensors of DINO's DINOHead (dino vision_transformer.py) as `head` (a
  heads.DINOHead) holds them, in the reference's names under 'head.': mlp, a bare Linear
  for one layer, else a Sequential of Linear [BN] GELU ... Linear; last_layer, the
  weight-normalised Linear (weight_v, and weight_g [out, 1], fixed at 1 with
  norm_last_layer, when it is not a parameter here: layout 'unit')."""
  linear = lambda name, i: [
    Entry(f"{name}.weight", "params", (f"Dense_{i}", "kernel"), "dense"),
    Entry(f"{name}.bias", "params", (f"Dense_{i}", "bias"), "same"),
  ]
  if head.num_layers == 1:
    out = linear("head.mlp", 0)
  else:
    out, index = [], 0
    for i in range(head.num_layers - 1):
      out += linear(f"head.mlp.{index}", i)
      if head.use_bn:
        out += _bn(f"head.mlp.{index + 1}", (f"BatchNorm_{i}",))
      index += 3 if head.use_bn else 2
    out += linear(f"head.mlp.{index}", head.num_layers - 1)
  out.append(Entry("head.last_layer.weight_v", "params", ("last_layer", "kernel"), "dense"))
  if head.norm_last_layer:
    out.append(Entry("head.last_layer.weight_g", "", (), "unit"))
  else:
    out.append(Entry("head.last_layer.weight_g", "params", ("last_layer", "g"), "column"))
  return out


def dino_network_from_state_dict(
  tensors: Dict[str, np.ndarray], path: str, model_config, head, image_size: int
) -> dict:
  """One network of a DINO main_dino.py checkpoint (its 'student' or 'teacher', a
  MultiCropWrapper's state dict: backbone.*, head.*, under 'module.' when it was
  DistributedDataParallel) as {'params', 'batch_stats'}, each {'encoder', 'projector'}
  (float32 numpy; batch_stats only for modules with BN).

  model_config: the encoder's config; head: the heads.DINOHead the run builds
  (config.dino), whose input is the encoder's width.

  Raises:
    WeightsError: the backbone, as from_state_dict; no head (naming the prefixes
      tried); a head tensor the run's head lacks or has and the file lacks, or of
      another shape (naming config.dino's fields to set); a last layer whose
      weight_g is not 1 where config.dino.norm_last_layer holds it at 1.
  """
  encoder = from_state_dict(tensors, path, model_config, image_size)
  wrapper = next((p for p in ("module.", "") if p + "head.last_layer.weight_v" in tensors), None)
  if wrapper is None:
    raise WeightsError(
      path, "has no DINO head (no 'head.last_layer.weight_v' under 'module.' or none)"
    )
  found = {
    name[len(wrapper) :]: value
    for name, value in tensors.items()
    if name.startswith(wrapper + "head.") and not name.endswith("num_batches_tracked")
  }
  x = jax.ShapeDtypeStruct((2, models.encoder_width(model_config)), jnp.float32)
  shapes = jax.eval_shape(lambda x: head.init(jax.random.PRNGKey(0), x, train=False), x)
  shapes = {
    c: flax.traverse_util.flatten_dict(shapes.get(c, {})) for c in ("params", "batch_stats")
  }
  expected = [e for e in _dino_head_entries(head) if e.layout != "counter"]
  config_fields = (
    f"config.dino (out_dim {head.out_dim}, hidden_dim {head.hidden_dim}, bottleneck_dim "
    f"{head.bottleneck_dim}, num_layers {head.num_layers}, use_bn_in_head {head.use_bn}, "
    f"norm_last_layer {head.norm_last_layer}) must describe the checkpoint's head"
  )
  names = {e.name for e in expected}
  missing = [e.name for e in expected if e.name not in found]
  unexpected = sorted(name for name in found if name not in names)
  if missing:
    raise WeightsError(
      path, f"has no tensor '{wrapper}{missing[0]}' of the run's DINO head: {config_fields}"
    )
  if unexpected:
    raise WeightsError(
      path,
      f"has a tensor '{wrapper}{unexpected[0]}' that the run's DINO head does not have: "
      + config_fields,
    )
  flat = {"params": {}, "batch_stats": {}}
  for entry in expected:
    value = np.asarray(found[entry.name], np.float32)
    if entry.layout == "unit":
      if value.shape != (head.out_dim, 1) or not np.all(value == 1):
        raise WeightsError(
          path,
          f"{entry.name} is not 1 (a last layer trained with norm_last_layer False): "
          "--config.dino.norm_last_layer=False",
        )
      continue
    want = shapes[entry.collection][entry.path].shape
    want = (want[0], 1) if entry.layout == "column" else _torch_shape(want, entry.layout)
    if value.shape != want:
      raise WeightsError(
        path,
        f"tensor {wrapper}{entry.name} has shape {list(value.shape)} where the run's head "
        f"needs {list(want)}: {config_fields}",
      )
    value = value[:, 0] if entry.layout == "column" else _from_torch(value, entry.layout)
    flat[entry.collection][entry.path] = value
  projector = {c: flax.traverse_util.unflatten_dict(flat[c]) for c in flat}
  return {
    c: {
      name: tree
      for name, tree in (("encoder", encoder[c]), ("projector", projector[c]))
      if tree or c == "params"
    }
    for c in ("params", "batch_stats")
  }
