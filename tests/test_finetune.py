"""Fine-tuning on few labels: the labelled subset, its bad inputs, and a tiny run."""

import hashlib
import json

from helpers import TFDS_DIR
from helpers import load_config
from helpers import tiny_config
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

from contrastive_jax import config_files
from contrastive_jax import methods
from contrastive_jax import models
from contrastive_jax.core import checkpointing
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core.errors import ResumeError
from contrastive_jax.data import crop_spec
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import labelled
from contrastive_jax.data import sources
from contrastive_jax.jobs import export
from contrastive_jax.jobs import finetune
from contrastive_jax.jobs import linear_probe
from contrastive_jax.methods import distillation
from contrastive_jax.training import downstream
from contrastive_jax.training import restore
from contrastive_jax.training import runner


def _reference_subset(ids, labels, fraction, seed):
  """The spec of select_labelled, written out: per class, round-half-up(fraction x count)
  of the ids with the smallest keyed BLAKE2b-64 (little-endian) hash."""
  chosen = set()
  for label in set(labels.tolist()):
    members = [i for i, l in zip(ids, labels) if l == label]
    rank = {
      i: int.from_bytes(
        hashlib.blake2b(i.encode(), digest_size=8, key=seed.to_bytes(8, "little")).digest(),
        "little",
      )
      for i in members
    }
    chosen.update(sorted(members, key=lambda i: (rank[i], i))[: int(fraction * len(members) + 0.5)])
  return chosen


def test_selection_is_class_balanced_fixed_and_independent_of_order():
  rng = np.random.default_rng(0)
  counts = {0: 100, 1: 50, 2: 7}  # Round half up: 10, 5 and 1 (0.7) at 10%.
  labels = np.repeat(list(counts), list(counts.values())).astype(np.int32)
  ids = np.array([f"photo_{i:03d}.jpg" for i in rng.permutation(len(labels))], dtype=object)
  chosen = labelled.select_labelled(ids, labels, 0.1, seed=0)
  assert np.all(np.diff(chosen) > 0)  # Sorted: the subset in read order.
  assert np.bincount(labels[chosen]).tolist() == [10, 5, 1]
  assert set(ids[chosen]) == _reference_subset(ids, labels, 0.1, 0)
  # The same (id, label) pairs in another order (another storage layout or
  # process count) select the same images.
  order = rng.permutation(len(ids))
  assert set(ids[order][labelled.select_labelled(ids[order], labels[order], 0.1, 0)]) == set(
    ids[chosen]
  )
  assert set(ids[labelled.select_labelled(ids, labels, 0.1, seed=1)]) != set(ids[chosen])
  assert len(labelled.select_labelled(ids, labels, 1.0, 0)) == len(ids)
  # Fixed ids: a change of the selection rule would change every run's subset.
  ids = np.array([f"img_{i:02d}" for i in range(20)], dtype=object)
  labels = np.arange(20, dtype=np.int32) % 2
  assert ids[labelled.select_labelled(ids, labels, 0.2, 0)].tolist() == [
    "img_07",
    "img_08",
    "img_14",
    "img_17",
  ]


def test_too_small_a_fraction_names_the_class_and_the_fraction_it_needs():
  ids = np.array([f"x{i}" for i in range(300)], dtype=object)
  labels = np.array([0] * 200 + [1] * 95 + [2] * 5, dtype=np.int32)
  with pytest.raises(
    ConfigError,
    match=r"config.label_fraction=0.05: must be in \[0.1, 1\], "
    r"so that every class keeps an image \(class 2 has 5 ",
  ):
    labelled.select_labelled(ids, labels, 0.05, 0)
  assert np.bincount(labels[labelled.select_labelled(ids, labels, 0.1, 0)]).tolist() == [20, 10, 1]


@pytest.fixture(scope="module")
def cifar():
  config = ml_collections.ConfigDict(dict(data_source="tfds", dataset="cifar10", data_dir=TFDS_DIR))
  return sources.get_source(config, {})


def test_each_process_reads_its_part_and_together_the_subset(cifar, monkeypatch):
  split = "train[100:164]"  # An offset slice: parts are read by absolute position.
  reference = {
    ex["id"].decode(): (ex["image"], ex["label"])
    for ex in tfds.as_numpy(tfds.builder("cifar10", data_dir=TFDS_DIR).as_dataset(split=split))
  }
  subset = labelled.LabelledSubset(cifar, split, 0.15, seed=0)  # 11 images.
  assert subset.ids.tolist() == [i for i in reference if i in set(subset.ids)]  # Read order.
  assert set(subset.ids) == _reference_subset(
    np.array(list(reference), dtype=object),
    np.array([l for _, l in reference.values()], np.int32),
    0.15,
    0,
  )

  def read(count, index):
    """Process `index` of `count`'s part, checked against the count it announces."""
    monkeypatch.setattr(jax, "process_count", lambda: count)
    monkeypatch.setattr(jax, "process_index", lambda: index)
    part = list(tfds.as_numpy(subset.read(split, drop_remainder=True)))
    assert len(part) == subset.process_counts(split, drop_remainder=True)[index]
    return part

  whole = read(1, 0)
  halves = read(2, 0), read(2, 1)
  assert (len(whole), len(halves[0]), len(halves[1])) == (len(subset.ids), 6, 5) == (11, 6, 5)
  for (image, label), name in zip(whole, subset.ids):
    np.testing.assert_array_equal(image, reference[name][0])
    assert label == reference[name][1] == subset.labels[list(subset.ids).index(name)]
  for (a, la), (b, lb) in zip(whole, halves[0] + halves[1]):
    np.testing.assert_array_equal(a, b)
    assert la == lb

  # The training stream over the subset resumes exactly (its epoch is the subset).
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  monkeypatch.setattr(jax, "process_index", lambda: 0)

  def stream(start_step, steps):
    ds = input_pipeline.train_dataset(
      subset,
      split,
      local_batch=4,
      image_size=32,
      crop=crop_spec.CropSpec("tensorflow", 0.5, "tf_bicubic"),
      seed=1,
      start_step=start_step,
      cache=True,
      shuffle_buffer=64,
      threads=1,
      num_views=1,
    )
    return [b["image"] for _, b in zip(range(steps), tfds.as_numpy(ds))]

  # 11 images, batch 4: step 3 starts inside epoch 2, step 5 crosses into epoch 3.
  for a, b in zip(stream(0, 7)[3:], stream(3, 4), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def pretrained_state(tmp_path_factory):
  """(a pretraining workdir with what downstream jobs read of it, that state on the host):
  the tiny SimCLR config and, at step 1, an encoder and a projection head of its shapes
  (a real run's checkpoint holds more, which the partial restore never reads;
  tests/test_linear_probe.py restores from one).

  The values are drawn on the host: compiling the ResNet's initialisers would take
  longer than the whole fine-tune.
  """
  workdir = tmp_path_factory.mktemp("pretrain")
  config = tiny_config()
  model = methods.get_method(config.method).build_model(config)
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)
  )
  rng = np.random.default_rng(0)

  def draw(path, leaf):
    if path[-1].key == "kernel":  # He-normal, as resnet.ResNet draws (fan-in here).
      return rng.normal(0, np.sqrt(2 / np.prod(leaf.shape[:-1])), leaf.shape).astype(np.float32)
    return (
      rng.uniform(0.5, 1.5, leaf.shape)
      if path[-1].key in ("scale", "var")
      else rng.normal(0, 0.1, leaf.shape)
    ).astype(np.float32)

  state = {
    name: {
      part: jax.tree_util.tree_map_with_path(draw, shapes[name][part])
      for part in ("encoder", "projector")
    }
    for name in ("params", "batch_stats")
  }
  ckpt = checkpointing.Checkpointer(str(workdir / "checkpoints"))
  ckpt.save(1, state, config)
  ckpt.close()
  return str(workdir), state


@pytest.fixture(scope="module")
def pretrained(pretrained_state):
  return pretrained_state[0]


def finetune_config(pretrain_workdir, **overrides):
  config = load_config("finetune", "runlocal")
  config.pretrain_workdir = pretrain_workdir
  config.data_dir = TFDS_DIR
  config.train_split = "train[:64]"
  config.label_fraction = 0.5
  config.evaluators.finetune.split = "test[:40]"
  config.evaluators.finetune.batch_size = 16
  config.batch_size = 16
  config.duration = "3 steps"
  config.optimizer.base_lr = 2.0  # Big steps, so that 3 of them move every weight.
  config.log_every = "1 steps"
  config.shuffle_buffer = 64
  config.data_threads = 1
  config.update(overrides)
  return config


@pytest.fixture(scope="module")
def finetuned(pretrained, tmp_path_factory):
  """A finished 3-step fine-tune: (config, workdir, the restored encoder variables, final
  state, final evaluation)."""
  workdir = tmp_path_factory.mktemp("finetune")
  config = finetune_config(pretrained)
  restored = jax.device_get(restore.restore_encoder(config, mesh_lib.make_mesh()).variables)
  state, result = runner.run(finetune, config, str(workdir))
  return config, workdir, restored, state, result


def test_finetune_trains_the_whole_encoder_and_reports_the_test_split(finetuned):
  _, workdir, restored, state, result = finetuned
  assert int(state.step) == 3
  tuned = jax.device_get(
    {"params": state.params["encoder"], "batch_stats": state.batch_stats["encoder"]}
  )
  # Every convolution and BN statistic moved. (Some BN scales, at 1.0, move by
  # less than float32 resolves in 3 steps.)
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), restored, tuned)
  assert all(jax.tree.leaves(moved["batch_stats"]))
  kernels = [
    changed
    for path, changed in jax.tree_util.tree_leaves_with_path(moved["params"])
    if path[-1].key == "kernel"
  ]
  # SimCLR's ResNet-10: the stem, 8 in blocks, 4 shortcuts (every stage's first block).
  assert len(kernels) == 13 and all(kernels)
  assert np.any(jax.device_get(state.params["head"]["kernel"]))
  with open(workdir / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [1, 2, 3]
  assert result == {k: records[-1][k] for k in ("finetune_top1", "finetune_top5")}
  # 40 test images: every fraction is a multiple of 1/40.
  assert round(result["finetune_top1"] * 40, 6) == round(result["finetune_top1"] * 40)


def test_the_subset_file_lists_the_images_and_survives_a_resume(finetuned):
  config, workdir, _, _, result = finetuned
  with open(workdir / "labelled_subset.csv") as f:
    text = f.read()
  lines = text.splitlines()
  subset = labelled.LabelledSubset(sources.get_source(config, {}), "train[:64]", 0.5, 0)
  assert lines == ["id,label"] + [f"{i},{l}" for i, l in zip(subset.ids, subset.labels)]
  split_labels = [
    ex["label"]
    for ex in tfds.as_numpy(
      tfds.builder("cifar10", data_dir=TFDS_DIR).as_dataset(split="train[:64]")
    )
  ]
  assert len(lines) - 1 == sum(int(n / 2 + 0.5) for n in np.bincount(split_labels))
  # Resuming the finished run reports the same numbers and keeps the file.
  assert runner.run(finetune, config, str(workdir))[1] == result
  with open(workdir / "labelled_subset.csv") as f:
    assert f.read() == text
  # A file that lists other images (the dataset changed under its name) stops a
  # resume; a fresh run writes its own.
  tampered = text.replace(lines[1], "train_99999,0")
  with open(workdir / "labelled_subset.csv", "w") as f:
    f.write(tampered)
  with pytest.raises(JobError, match="labelled_subset.csv lists another labelled subset"):
    finetune.record_subset(subset, str(workdir), resumed=True)
  with open(workdir / "labelled_subset.csv") as f:
    assert f.read() == tampered
  finetune.record_subset(subset, str(workdir), resumed=False)
  with open(workdir / "labelled_subset.csv") as f:
    assert f.read() == text


def test_resume_refuses_another_config_or_another_job(finetuned, pretrained):
  config, workdir, _, _, _ = finetuned
  other = ml_collections.ConfigDict(config.to_dict())
  other.optimizer.base_lr = 0.5
  with pytest.raises(ResumeError, match=r"^config.optimizer.base_lr=0.5 \(the checkpoint's: "):
    runner.run(finetune, other, str(workdir))
  # The labelled subset's fields are named too, not blamed on a changed dataset.
  other = ml_collections.ConfigDict(config.to_dict())
  other.label_fraction = 0.25
  with pytest.raises(ResumeError, match=r"^config.label_fraction=0.25 \(the checkpoint's: 0.5\)"):
    runner.run(finetune, other, str(workdir))
  probe = load_config("linear_probe")
  probe.pretrain_workdir = pretrained
  with pytest.raises(ConfigError, match="config.job='linear_probe': must be 'finetune'"):
    runner.run(linear_probe, probe, str(workdir))


def test_a_fine_tuning_workdir_teaches_distillation_with_its_fine_tuned_encoder(
  finetuned, pretrained_state
):
  # The fine-tuning workdir as distillation's teacher: its step, the pretraining run's model
  # and its encoder's key paths recorded; the variables read are the fine-tuned encoder's
  # (params and BN statistics), not the pretraining checkpoint's.
  _, workdir, _, state, _ = finetuned
  _, pretrained_variables = pretrained_state
  config = tiny_config("distill", "runlocal")
  config.distill.teacher = str(workdir)
  recorded = distillation.recorded_config(config, restore.checkpoint_encoder)
  assert recorded.distill.teacher_step == 3
  # The model as its checkpoint saved it (JSON: tuples as lists).
  model = json.loads(json.dumps(tiny_config().model.to_dict()))
  assert recorded.distill.teacher_model.to_dict() == model
  assert recorded.distill.teacher_paths == [["params", "encoder"], ["batch_stats", "encoder"]]
  teacher = jax.device_get(distillation.load_teacher(recorded, mesh_lib.make_mesh()))
  jax.tree.map(np.testing.assert_array_equal, teacher["params"], state.params["encoder"])
  jax.tree.map(np.testing.assert_array_equal, teacher["batch_stats"], state.batch_stats["encoder"])
  assert not np.array_equal(
    teacher["params"]["stem_conv"]["kernel"],
    pretrained_variables["params"]["encoder"]["stem_conv"]["kernel"],
  )
  # What cannot be a teacher: one line each.
  ckpt = checkpointing.Checkpointer(str(workdir / "checkpoints"), read_only=True)
  try:
    saved = ckpt.saved_config()
  finally:
    ckpt.close()
  bad = ml_collections.ConfigDict(saved.to_dict())
  bad.projector_layers = 1
  with pytest.raises(
    ConfigError,
    match="^config.distill.teacher=.*: must be .*projector_layers 0 .*fine-tuned 1 projection-head",
  ):
    restore.checkpoint_encoder("distill.teacher", str(workdir), bad)
  # A fine-tuning run of a weights file whose model no config names (no export.json beside).
  bad = ml_collections.ConfigDict(saved.to_dict())
  bad.pretrain_workdir = "/w/resnet18.safetensors"
  with pytest.raises(ConfigError, match="^config.pretrain_config=None: .*/w/resnet18.safetensors"):
    restore.checkpoint_encoder("distill.teacher", str(workdir), bad)


def test_a_fine_tuning_workdir_is_a_pretrained_encoder_for_the_downstream_jobs(
  finetuned, pretrained
):
  # restore_encoder of the fine-tuning workdir: its fine-tuned encoder, as the pretraining
  # run's model (and its image size), at the fine-tuning checkpoint's step.
  _, workdir, _, state, _ = finetuned
  config = finetune_config(str(workdir))
  encoder = restore.restore_encoder(config, mesh_lib.make_mesh())
  assert encoder.step == 3 and encoder.pretrained.model.to_dict() == json.loads(
    json.dumps(tiny_config().model.to_dict())
  )
  variables = jax.device_get(encoder.variables)
  jax.tree.map(np.testing.assert_array_equal, variables["params"], state.params["encoder"])
  jax.tree.map(
    np.testing.assert_array_equal, variables["batch_stats"], state.batch_stats["encoder"]
  )
  assert restore.is_finetuning_workdir(str(workdir)) and not restore.is_finetuning_workdir(
    pretrained
  )
  with pytest.raises(ConfigError, match="^config.random_init=True: must be False with a fine-t"):
    restore.restore_encoder(finetune_config(str(workdir), random_init=True), mesh_lib.make_mesh())
  with pytest.raises(ConfigError, match="^config.projector_layers=1: must be 0: a fine-tuning"):
    restore.with_head_layers(config, encoder, 1, "projector_layers", mesh_lib.make_mesh())
  # The export job serves no projection head from it.
  exported = load_config("export")
  exported.update(pretrain_workdir=str(workdir), format="saved_model", projection=True)
  with pytest.raises(ConfigError, match="^config.projection=True: .*a fine-tuning workdir"):
    export.check_config(exported)


class _Unlabeled(sources.TfdsSource):
  """CIFAR-10 without its labels, as an unlabeled image folder reads."""

  num_classes = None


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_fraction_outside_0_1_stops_before_any_compute(fraction, tmp_path):
  with pytest.raises(ConfigError, match=rf"config.label_fraction={fraction}: must be in \(0, 1\]"):
    runner.run(finetune, finetune_config("unused", label_fraction=fraction), str(tmp_path))
  assert not (tmp_path / "labelled_subset.csv").exists()


def test_bad_datasets_stop_before_any_compute(pretrained, tmp_path, monkeypatch):
  with pytest.raises(
    ConfigError,
    match=r"config.label_fraction=0.01: must be in \[0.\d+, 1\], "
    "so that every class keeps an image",
  ):
    runner.run(finetune, finetune_config(pretrained, label_fraction=0.01), str(tmp_path))
  with pytest.raises(
    ConfigError,
    match=r"config.batch_size=48: must be at most the labelled "
    r"subset.s size \(34 images: ",
  ):
    runner.run(finetune, finetune_config(pretrained, batch_size=48), str(tmp_path))
  monkeypatch.setitem(sources.SOURCES, "unlabeled", _Unlabeled)
  with pytest.raises(
    ConfigError,
    match="config.dataset='cifar10': must be a labelled dataset: fine-tuning trains on labels",
  ):
    runner.run(finetune, finetune_config(pretrained, data_source="unlabeled"), str(tmp_path))
  assert not (tmp_path / "labelled_subset.csv").exists()
  assert not list((tmp_path / "checkpoints").iterdir())


def test_learning_rate_multipliers_decay_layer_by_layer():
  # A ViT of 2 blocks as BEiT numbers its layers: patch embedding and class token 0,
  # block k k + 1, the final LayerNorm and the head 3 (= L + 1).
  leaf = jnp.zeros(2)
  vit = {
    "patch_embed": {"kernel": leaf},
    "cls_token": leaf,
    "block0": {"attn": {"qkv": {"kernel": leaf}}},
    "block1": {"norm1": {"scale": leaf}},
    "norm": {"scale": leaf},
  }
  got = downstream.learning_rate_multipliers(
    {"encoder": vit, "head": {"kernel": leaf}}, backbone=0.5, layer_decay=0.1
  )
  assert got == {
    "encoder": {
      "patch_embed": {"kernel": 0.5 * 0.1**3},
      "cls_token": 0.5 * 0.1**3,
      "block0": {"attn": {"qkv": {"kernel": 0.5 * 0.1**2}}},
      "block1": {"norm1": {"scale": 0.5 * 0.1}},
      "norm": {"scale": 0.5},
    },
    "head": {"kernel": 1.0},
  }
  # A ResNet's stem precedes its blocks, numbered BasicBlock_0...
  resnet = {"stem_conv": {"kernel": leaf}, "BasicBlock_0": {"Conv_0": {"kernel": leaf}}}
  got = downstream.learning_rate_multipliers(
    {"encoder": resnet, "head": {"bias": leaf}}, backbone=1.0, layer_decay=0.5
  )
  assert got["encoder"] == {
    "stem_conv": {"kernel": 0.25},
    "BasicBlock_0": {"Conv_0": {"kernel": 0.5}},
  }


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("backbone_lr_multiplier", 0.0, r"config.backbone_lr_multiplier=0.0: must be > 0"),
    ("layer_decay", 1.5, r"config.layer_decay=1.5: must be in \(0, 1\]"),
  ],
)
def test_bad_multipliers_stop_before_any_compute(field, value, message, tmp_path):
  with pytest.raises(ConfigError, match=message):
    runner.run(finetune, finetune_config("unused", **{field: value}), str(tmp_path))


def test_an_older_finetune_config_trained_at_one_rate():
  saved = load_config("finetune")
  del saved["backbone_lr_multiplier"], saved["layer_decay"], saved["projector_layers"]
  upgraded = config_files.upgrade_config(saved)
  assert (upgraded.backbone_lr_multiplier, upgraded.layer_decay) == (1.0, 1.0)
  assert upgraded.projector_layers == 0  # It fine-tuned from h.


def test_the_head_layer_network_is_the_encoder_then_the_heads_first_layer(pretrained_state):
  """projector_layers=1 (SimCLR v2's fine-tuning): the restored network's h is, in eval
  mode, ReLU(BN(h @ W)) of the checkpoint's own projection head's first layer (numpy)."""
  workdir, state = pretrained_state
  config = finetune_config(workdir, projector_layers=1)
  mesh = mesh_lib.make_mesh()
  encoder = restore.restore_encoder(config, mesh)
  tuned = restore.with_head_layers(config, encoder, 1, "projector_layers", mesh)
  images = np.random.default_rng(1).integers(0, 256, (4, 32, 32, 3), np.uint8)
  h = np.asarray(models.encode(encoder.module, encoder.variables, images), np.float64)
  params, stats = state["params"]["projector"], state["batch_stats"]["projector"]
  x = h @ params["Dense_0"]["kernel"]
  bn, moments = params["BatchNorm_0"], stats["BatchNorm_0"]
  want = np.maximum(
    (x - moments["mean"]) / np.sqrt(moments["var"] + 1e-5) * bn["scale"] + bn["bias"], 0
  )
  got = models.encode(tuned.module, tuned.variables, images)
  assert tuned.dim == want.shape[1] == got.shape[1]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  assert "Dense_1" not in tuned.variables["params"]["projector"]  # Only the first layer.


@pytest.fixture(scope="module")
def head_layer_run(pretrained_state, tmp_path_factory):
  """A finished 3-step fine-tune from the projection head's first layer, with layer-wise
  decay and a lower backbone rate: one run serves the tests of both. (config, workdir, the
  restored encoder variables, the pretraining state, final state, final evaluation)."""
  pretrained, state = pretrained_state
  workdir = str(tmp_path_factory.mktemp("head_layer"))
  config = finetune_config(
    pretrained, projector_layers=1, backbone_lr_multiplier=0.5, layer_decay=1e-3
  )
  restored = jax.device_get(restore.restore_encoder(config, mesh_lib.make_mesh()).variables)
  final, result = runner.run(finetune, config, workdir)
  return config, workdir, restored, state, final, result


def test_a_decayed_encoder_moves_less_the_nearer_its_input(head_layer_run):
  """With layer_decay 1e-3 the stem's rate is 1e-15 of the head's (4 blocks, the head layer
  after them at the backbone's 0.5): its kernel stays as restored (below float32's
  resolution) while the last block's moves; the plain recipe moves both
  (test_finetune_trains_the_whole_encoder_and_reports_the_test_split)."""
  _, _, restored, _, final, _ = head_layer_run
  tuned = jax.device_get(final.params["encoder"]["encoder"])
  stem = restored["params"]["stem_conv"]["kernel"]
  np.testing.assert_array_equal(tuned["stem_conv"]["kernel"], stem)
  last = restored["params"]["BasicBlock_3"]["Conv_1"]["kernel"]
  assert not np.array_equal(tuned["BasicBlock_3"]["Conv_1"]["kernel"], last)


def test_finetune_from_the_heads_first_layer_trains_it_and_resumes(head_layer_run):
  config, workdir, _, state, final, result = head_layer_run
  head_layer = jax.device_get(final.params["encoder"]["projector"]["Dense_0"]["kernel"])
  assert not np.array_equal(head_layer, state["params"]["projector"]["Dense_0"]["kernel"])
  assert final.params["head"]["kernel"].shape[0] == head_layer.shape[1]
  assert set(final.batch_stats["encoder"]) == {"encoder", "projector"}
  again, result_again = runner.run(finetune, config, workdir)  # Finished: restored.
  assert int(again.step) == int(final.step) and result_again == result


def test_random_init_head_layers_are_the_runs_initialisation(pretrained):
  config = finetune_config(pretrained, projector_layers=1, random_init=True)
  mesh = mesh_lib.make_mesh()
  tuned = restore.with_head_layers(
    config, restore.restore_encoder(config, mesh), 1, "projector_layers", mesh
  )
  saved = tiny_config()
  model = methods.get_method(saved.method).build_model(saved)
  init_rng, _ = methods.run_keys(saved.seed)
  x = jnp.zeros((1, 32, 32, 3))
  drawn = jax.jit(lambda: model.init(init_rng, x, train=False))()
  np.testing.assert_array_equal(
    tuned.variables["params"]["projector"]["Dense_0"]["kernel"],
    drawn["params"]["projector"]["Dense_0"]["kernel"],
  )


@pytest.mark.parametrize(
  "layers, message",
  [
    (
      2,
      r"projector_layers=2: must be an integer in \[0, 1\]: simclr's projection head \(MLP\) has 1",
    ),
    (-1, r"config.projector_layers=-1: must be an integer >= 0"),
  ],
)
def test_head_layers_the_head_lacks_stop_before_any_compute(pretrained, layers, message, tmp_path):
  with pytest.raises(ConfigError, match=message):
    runner.run(finetune, finetune_config(pretrained, projector_layers=layers), str(tmp_path))
  assert not list(tmp_path.glob("checkpoints/*"))


def test_multipliers_put_the_head_layers_after_the_last_block():
  leaf = jnp.zeros(2)
  wrapped = {
    "encoder": {"stem_conv": {"kernel": leaf}, "BasicBlock_0": {"Conv_0": {"kernel": leaf}}},
    "projector": {"Dense_0": {"kernel": leaf}},
  }
  got = downstream.learning_rate_multipliers(
    {"encoder": wrapped, "head": {"bias": leaf}}, backbone=0.5, layer_decay=0.5
  )
  assert got["encoder"] == {
    "encoder": {"stem_conv": {"kernel": 0.125}, "BasicBlock_0": {"Conv_0": {"kernel": 0.25}}},
    "projector": {"Dense_0": {"kernel": 0.5}},
  }
