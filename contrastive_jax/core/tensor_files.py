"""Files of named tensors: safetensors (read and written with numpy alone) and PyTorch .pth.

The safetensors format (huggingface/safetensors, its README's "Format"):
8 bytes, a little-endian uint64 N; N bytes of JSON mapping each tensor's name
to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the byte
buffer that follows), plus an optional "__metadata__" of strings; then the
buffer, each tensor C-ordered and little-endian. Parsing it here keeps the
`safetensors` package (and torch) out of the base install; .pth files need
torch (the `torch` extra), imported only when one is read or written.
"""

import argparse
import io
import json
import struct
from typing import Dict

import ml_dtypes
import numpy as np

from contrastive_jax.core import files
from contrastive_jax.core.errors import WeightsError

# safetensors dtype name -> numpy dtype (little-endian).
_DTYPES = {
  "F64": np.dtype("<f8"),
  "F32": np.dtype("<f4"),
  "F16": np.dtype("<f2"),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "I64": np.dtype("<i8"),
  "I32": np.dtype("<i4"),
  "I16": np.dtype("<i2"),
  "I8": np.dtype("i1"),
  "U8": np.dtype("u1"),
  "BOOL": np.dtype("?"),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
SAFETENSORS = ".safetensors"
TORCH_SUFFIXES = (".pth", ".pth.tar", ".pt", ".bin")
_MAX_HEADER = 100_000_000  # The reference implementation's limit on the JSON header, bytes.


def is_weights_file(path: str) -> bool:
  """Whether path's name is that of a weights file (kind's suffixes), not a directory's."""
  return path.endswith((SAFETENSORS,) + TORCH_SUFFIXES) and not files.isdir(path)


def kind(path: str) -> str:
  """'safetensors' or 'torch' by the file name's suffix.

  Raises:
    WeightsError: another suffix.
  """
  if path.endswith(SAFETENSORS):
    return "safetensors"
  if path.endswith(TORCH_SUFFIXES):
    return "torch"
  raise WeightsError(
    path,
    f"not a weights file: the name must end in {SAFETENSORS} or one of {', '.join(TORCH_SUFFIXES)}",
  )


def read(path: str) -> Dict[str, np.ndarray]:
  """The named tensors of a safetensors or PyTorch file (local or gs://), as numpy arrays.

  A PyTorch checkpoint that holds its weights under one of STATE_DICT_KEYS (MoCo's and
  MoCo v3's .pth.tar, timm's training checkpoints, DINO's teacher) is unwrapped
  (state_dict); non-tensor entries (an epoch, an optimizer state) are dropped.

  Raises:
    WeightsError: a missing file, a suffix neither names, a file that is not
      in the format its suffix says, a .pth without torch installed, a
      checkpoint with no state dict (see state_dict).
  """
  return state_dict(read_entries(path), path)


def read_entries(path: str) -> Dict[str, Dict[str, np.ndarray]]:
  """Every state dict of a weights file: {entry: {name: numpy array}}.

  A PyTorch checkpoint's top-level entries that hold tensors, each by its key (a DINO
  main_dino.py checkpoint: 'student', 'teacher', 'dino_loss'), and its own top-level
  tensors, if any, under ''; a safetensors file's tensors under ''. Entries without
  tensors (an epoch, an optimizer's nested state, arguments) are left out.

  Raises:
    WeightsError: as read; a file with no tensors.
  """
  which, loaded = _load(path)
  if which == "safetensors":
    entries = {"": loaded}
  elif not isinstance(loaded, dict):
    raise WeightsError(path, f"a PyTorch file holding a {type(loaded).__name__}, not a state dict")
  else:
    entries = {k: _torch_tensors(v) for k, v in loaded.items() if isinstance(v, dict)}
    entries[""] = _torch_tensors(loaded)
  entries = {k: v for k, v in entries.items() if v}
  if not entries:
    raise WeightsError(path, "a file with no tensors")
  return entries


def _load(path: str):
  """(kind(path), content): a safetensors file's {name: array}, or what torch.load gives."""
  which = kind(path)
  if not files.exists(path):
    raise WeightsError(path, "no such file")
  with files.open_file(path, "rb") as f:
    content = f.read()
  if which == "safetensors":
    return which, _parse_safetensors(path, content)
  return which, _load_torch(path, content)


def _parse_safetensors(path: str, content: bytes) -> Dict[str, np.ndarray]:
  def bad(why):
    return WeightsError(path, f"not a safetensors file ({why})")

  if len(content) < 8:
    raise bad("shorter than its 8-byte header length")
  (size,) = struct.unpack("<Q", content[:8])
  if size > min(_MAX_HEADER, len(content) - 8):
    raise bad(f"a header length of {size} bytes in a file of {len(content)}")
  try:
    header = json.loads(content[8 : 8 + size])
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise bad(f"its header is not JSON: {e}") from None
  if not isinstance(header, dict):
    raise bad("its header is not a JSON object")
  buffer = memoryview(content)[8 + size :]
  tensors = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    try:
      dtype = _DTYPES[entry["dtype"]]
      shape = tuple(int(n) for n in entry["shape"])
      begin, end = (int(n) for n in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
      raise bad(f"entry {name!r} is not {{dtype, shape, data_offsets}} of a known dtype") from None
    if not 0 <= begin <= end <= len(buffer) or end - begin != dtype.itemsize * int(
      np.prod(shape, dtype=np.int64)
    ):
      raise bad(
        f"tensor {name!r}: data_offsets {[begin, end]} do not hold shape {list(shape)} "
        f"of {entry['dtype']} in a buffer of {len(buffer)} bytes"
      )
    tensors[name] = np.frombuffer(buffer[begin:end], dtype).reshape(shape).copy()
  return tensors


# Where PyTorch checkpoints keep their state dict, tried in this order: MoCo's and MoCo
# v3's .pth.tar and timm's training checkpoints ('state_dict'), others' ('model'), DINO's
# main_dino.py checkpoint ('teacher': its evaluations' default --checkpoint_key).
STATE_DICT_KEYS = ("state_dict", "model", "teacher")


def state_dict(entries: Dict[str, Dict[str, np.ndarray]], path: str) -> Dict[str, np.ndarray]:
  """The state dict of a file's entries (read_entries): the first of STATE_DICT_KEYS it
  holds, else its top-level tensors.

  Raises:
    WeightsError: neither (naming the entries it holds).
  """
  for key in STATE_DICT_KEYS + ("",):
    if key in entries:
      return entries[key]
  raise WeightsError(
    path,
    f"no state dict: it holds {sorted(entries)}, and neither tensors at its top level nor "
    f"one of {list(STATE_DICT_KEYS)}",
  )


def _load_torch(path: str, content: bytes):
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise WeightsError(
      path,
      "reading a PyTorch file needs torch: pip install "
      "'contrastive_jax[torch]', or convert it to .safetensors",
    ) from None
  try:
    # DINO's checkpoints hold its argparse.Namespace of arguments, a plain attribute
    # holder: allowed beside the tensors, nothing else is unpickled.
    with torch.serialization.safe_globals([argparse.Namespace]):
      return torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)
  except Exception as e:  # pylint: disable=broad-except
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise WeightsError(path, f"not a PyTorch checkpoint torch can read safely ({first})") from None


def _torch_tensors(state: dict) -> Dict[str, np.ndarray]:
  """The torch tensors of a dict as numpy arrays (floating ones as float32), others dropped."""
  import torch  # pylint: disable=import-outside-toplevel

  return {
    name: value.detach().cpu().float().numpy()
    if value.is_floating_point()
    else value.detach().cpu().numpy()
    for name, value in state.items()
    if isinstance(value, torch.Tensor)
  }


def safetensors_bytes(tensors: Dict[str, np.ndarray], metadata: Dict[str, str] = None) -> bytes:
  """The safetensors encoding of named numpy arrays (sorted by name, header 8-byte aligned)."""
  header, chunks, offset = {}, [], 0
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  for name in sorted(tensors):
    array = np.asarray(tensors[name])
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype not in _NAMES:
      raise ValueError(f"tensor {name!r}: dtype {array.dtype} has no safetensors name")
    data = array.astype(dtype).tobytes(order="C")
    header[name] = {
      "dtype": _NAMES[dtype],
      "shape": list(array.shape),
      "data_offsets": [offset, offset + len(data)],
    }
    chunks.append(data)
    offset += len(data)
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)
  return struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks)


def write(path: str, tensors: Dict[str, np.ndarray], metadata: Dict[str, str] = None):
  """Writes named arrays atomically (files.write_atomic) as safetensors or, for a
  TORCH_SUFFIXES name, as a torch.save'd state dict of tensors (needs torch).

  Raises:
    WeightsError: see kind; a .pth without torch installed.
  """
  if kind(path) == "safetensors":
    files.write_atomic(path, safetensors_bytes(tensors, metadata))
    return
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise WeightsError(
      path,
      "writing a PyTorch file needs torch: pip install "
      "'contrastive_jax[torch]', or write .safetensors",
    ) from None
  buffer = io.BytesIO()
  torch.save({name: torch.from_numpy(np.array(value)) for name, value in tensors.items()}, buffer)
  files.write_atomic(path, buffer.getvalue())
