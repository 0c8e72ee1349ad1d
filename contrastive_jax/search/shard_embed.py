"""Embedding one shard (shards.py) of a source with an encoder: the embed job's inner loop.

What the embed job's two engines share (jobs/embed.py on JAX processes, beam_embed.py on
Apache Beam workers), so that both write the same rows to the same files: a shard's
batches (shard_dataset), the encoder run over them (embed_batches) and the shard's
files' content (shard_content, then shards.write). The encoder is any object with the
`embed` and `eval_crop` of restore.EmbedModel: no checkpoint code here.
"""

from clu import periodic_actions
import jax
from jax.experimental import multihost_utils
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.data import sources
from contrastive_jax.search import shards as shards_lib


def num_batches(shards: list, local_batch: int) -> int:
  """Batches of local_batch that hold the longest of shards (each process runs as many)."""
  return -(-max(shard.stop - shard.start for shard in shards) // local_batch)


def shard_dataset(source, split, shard, eval_crop, local_batch: int, batches: int, threads: int):
  """This process's batches of `shard` (None: padding only), `batches` of local_batch.

  Elements as input_pipeline.eval_dataset's with names: image uint8 [b, S, S, 3]
  (eval_crop), label int32 [b], mask bool [b], name bytes [b]; the rows past
  the shard's are padding (mask False). threads: the decoding's parallel calls.
  """
  pad = tf.data.Dataset.from_tensors(
    {
      "image": tf.zeros([eval_crop.size, eval_crop.size, 3], tf.uint8),
      "label": tf.constant(0, tf.int32),
      "mask": False,
      "name": tf.constant(""),
    }
  ).repeat()
  ds = pad
  if shard is not None:
    ds = (
      source.read_range(split, shard.start, shard.stop, names=True)
      .map(
        lambda image, label, name: {
          "image": eval_crop.apply(image),
          "label": label,
          "mask": True,
          "name": name,
        },
        num_parallel_calls=threads,
      )
      .concatenate(pad)
    )
  return ds.take(batches * local_batch).batch(local_batch, drop_remainder=True).prefetch(2)


def embed_batches(model, ds: tf.data.Dataset, mesh, batches: int):
  """This process's (h float32 [n, D], labels int32 [n], names [n]) of ds, in order, padding
  dropped.

  Every process of the mesh runs `batches` batches of ds (shard_dataset's), its own rows
  each; model.embed runs on the global batch.
  """
  sharding = mesh_lib.batch_sharded(mesh)
  progress = periodic_actions.ReportProgress(num_train_steps=batches, every_secs=30)
  h, labels, names = [], [], []

  def collect(embedded, local):
    keep = local["mask"]
    rows = np.asarray(
      multihost_utils.global_array_to_host_local_array(embedded, mesh, jax.P(mesh_lib.DATA_AXIS))
    )
    h.append(rows[keep])
    labels.append(local["label"][keep])
    names.extend(name.decode() for name in local["name"][keep])

  pending = None
  for i, local in enumerate(tfds.as_numpy(ds)):
    embedded = model.embed(jax.make_array_from_process_local_data(sharding, local["image"]))
    if pending is not None:  # Copied to the host while the device embeds the next batch.
      collect(*pending)
    pending = (embedded, local)
    progress(i + 1)
  collect(*pending)
  return np.concatenate(h), np.concatenate(labels), names


def shard_content(shard, embedded: tuple, source, first_id: int, rows: dict) -> tuple:
  """(h, rows, unreadable): shards.write's arguments for `shard`'s embedded rows.

  embedded: embed_batches's (h, labels, names) of the shard, read from source just before
  (a folder's `unreadable` then lists the shard's files that could not be decoded).
  rows: {"split", "relabel": source label -> index label, "labelled": bool}. A row's id is
  first_id plus its position in the split or file list.
  """
  h, labels, names = embedded
  if isinstance(source, sources.FolderSource):  # Files that cannot be decoded have no row.
    position = {path: i for i, path in enumerate(source.files[shard.start : shard.stop])}
    positions = [position[name] for name in names]
    unreadable = [f"{path}\t{why}" for path, why in source.unreadable]
  else:
    positions, unreadable = range(len(h)), []
  content = {
    "id": [first_id + shard.start + p for p in positions],
    "name": names,
    "label": [
      rows["relabel"][int(label)] if rows["labelled"] and label >= 0 else None for label in labels
    ],
    "split": rows["split"],
  }
  return h, content, unreadable


def write_shard(workdir: str, shard, content: tuple):
  """Writes shard_content's (h, rows, unreadable) as `shard`'s files (shards.write)."""
  shards_lib.write(workdir, shard.number, *content)
