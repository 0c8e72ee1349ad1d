"""Evaluators: the sharded kNN monitor and classifier accuracy against numpy references."""

import inspect

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import NonFiniteError
from contrastive_jax.training import evaluators


def test_weighted_vote_hand_worked():
  # Query at angle 0. Bank: two class-1 points at +-60 degrees (sim 0.5 each),
  # one class-0 point at 0 degrees (sim 1.0). With t = 0.1:
  # class 0 vote e^10 = 22026; class 1 votes 2 e^5 = 297 -> class 0.
  # With t = 1: class 0 e^1 = 2.72; class 1 2 e^0.5 = 3.30 -> class 1.
  sims, labels = jnp.array([[0.5, 0.5, 1.0]]), jnp.array([1, 1, 0])

  def predict(k, t):
    top_sims, top_labels = evaluators.top_k_neighbours(sims, labels, k)
    return int(evaluators.knn_vote(top_sims, top_labels, num_classes=2, temperature=t)[0])

  assert predict(3, 0.1) == 0 and predict(3, 1.0) == 1
  assert predict(1, 1.0) == 0  # Only the nearest neighbour votes.
  assert predict(200, 1.0) == 1  # k larger than the bank: the whole bank.


def knn_numpy(bank, bank_labels, queries, k, t, num_classes):
  """Wu et al. 2018's weighted kNN written out: cosine sims, k nearest vote exp(s / t)."""
  bank = bank / np.linalg.norm(bank, axis=1, keepdims=True)
  queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
  preds = []
  for q in queries:
    sims = bank @ q
    nearest = np.argsort(-sims)[:k]
    votes = np.zeros(num_classes)
    for i in nearest:
      votes[bank_labels[i]] += np.exp(sims[i] / t)
    preds.append(np.argmax(votes))
  return np.array(preds)


def _eval_model(images_by_split, labels_by_split, logits=None):
  """An EvalModel whose h is the flattened image, over in-memory splits."""

  def dataset(split, local_batch):
    images, labels = images_by_split[split], labels_by_split[split]
    n = len(images)
    padded = -(-n // local_batch) * local_batch
    pad = padded - n
    image = np.concatenate([images, np.zeros((pad,) + images.shape[1:], np.uint8)])
    label = np.concatenate([labels, np.zeros(pad, np.int32)])
    mask = np.arange(padded) < n
    return [
      {
        "image": image[i : i + local_batch],
        "label": label[i : i + local_batch],
        "mask": mask[i : i + local_batch],
      }
      for i in range(0, padded, local_batch)
    ]

  features = lambda v, x: x.reshape(x.shape[0], -1).astype(jnp.float32) * v
  return evaluators.EvalModel(
    variables=lambda state: state, features=features, logits=logits, dataset=dataset
  )


@pytest.mark.parametrize("k", [1, 5, 200])
def test_sharded_knn_equals_numpy_reference(k):
  rng = np.random.default_rng(0)
  images = {
    "bank": rng.integers(1, 256, (203, 2, 2, 3), np.uint8),  # Padded to 208.
    "test": rng.integers(1, 256, (45, 2, 2, 3), np.uint8),
  }
  labels = {
    "bank": rng.integers(0, 4, 203).astype(np.int32),
    "test": rng.integers(0, 4, 45).astype(np.int32),
  }
  cfg = ml_collections.ConfigDict(
    dict(
      kind="knn",
      every="1 steps",
      split="test",
      bank_split="bank",
      k=k,
      temperature=0.1,
      batch_size=16,
    )
  )
  mesh = mesh_lib.make_mesh()
  knn = evaluators.Knn("knn", cfg, _eval_model(images, labels), mesh, num_classes=4)
  result = knn(jnp.float32(1.0))
  flat = {s: images[s].reshape(len(images[s]), -1).astype(np.float64) for s in images}
  expected = knn_numpy(flat["bank"], labels["bank"], flat["test"], k, 0.1, 4)
  assert result == {"knn_top1": np.mean(expected == labels["test"])}
  # One device gives the same answer as eight.
  one = evaluators.Knn(
    "knn", cfg, _eval_model(images, labels), mesh_lib.make_mesh(jax.devices()[:1]), num_classes=4
  )
  assert one(jnp.float32(1.0)) == result


def test_knn_refuses_a_nan_or_infinite_h_naming_how_many():
  rng = np.random.default_rng(0)
  images = {
    "bank": rng.integers(1, 255, (203, 2, 2, 3), np.uint8),
    "test": rng.integers(1, 255, (45, 2, 2, 3), np.uint8),
  }
  images["test"][[0, 5, 44], 0, 0, 0] = 255  # h NaN, inf, inf (the others finite).
  images["bank"][[1, 202], 0, 0, 0] = 255
  labels = {s: np.zeros(len(x), np.int32) for s, x in images.items()}
  model = _eval_model(images, labels)
  values = jnp.asarray([1.0, np.nan, np.inf, np.inf])

  def features(v, x):
    h = model.features(v, x)
    marked = (x[:, 0, 0, 0] == 255)[:, None]
    return jnp.where(marked, values[jnp.arange(h.shape[0]) % 3 + 1][:, None], h)

  cfg = ml_collections.ConfigDict(
    dict(split="test", bank_split="bank", k=5, temperature=0.1, batch_size=16)
  )
  knn = evaluators.Knn("knn", cfg, model._replace(features=features), mesh_lib.make_mesh(), 4)
  with pytest.raises(
    NonFiniteError,
    match=r"^knn: the encoder's h is NaN or infinite for 3 of "
    r"the 45 query images \(test\) and 2 bank images \(bank\); no figure",
  ):
    knn(jnp.float32(1.0))


@pytest.mark.parametrize("num_classes,names", [(10, {"c_top1", "c_top5"}), (2, {"c_top1"})])
def test_classifier_counts_every_image_once_and_top5_only_with_5_classes(num_classes, names):
  rng = np.random.default_rng(1)
  images = {"test": rng.integers(0, 256, (37, 1, 1, 3), np.uint8)}
  labels = {"test": rng.integers(0, num_classes, 37).astype(np.int32)}
  w = rng.normal(size=(3, num_classes)).astype(np.float32)
  model = _eval_model(images, labels, logits=lambda v, x: x.reshape(-1, 3).astype(jnp.float32) @ v)
  cfg = ml_collections.ConfigDict(
    dict(kind="classifier", every="1 steps", split="test", batch_size=8)
  )
  result = evaluators.Classifier("c", cfg, model, mesh_lib.make_mesh(), num_classes)(jnp.asarray(w))
  assert set(result) == names
  logits = images["test"].reshape(-1, 3).astype(np.float32) @ w
  ranks = np.argsort(-logits, axis=1)
  for k in (1, 5)[: len(names)]:
    hits = [labels["test"][i] in ranks[i, :k] for i in range(37)]
    assert result[f"c_top{k}"] == pytest.approx(np.mean(hits), abs=1e-12)


class _Unlabeled:
  """A data source without labels, as an unlabelled image folder is."""

  name, num_classes = "photos", None

  def num_examples(self, split, field):
    return 100


@pytest.mark.parametrize("name,kind", [("knn", "knn"), ("online_probe", "classifier")])
def test_evaluators_that_need_labels_refuse_an_unlabeled_dataset(name, kind):
  evaluators_config = ml_collections.ConfigDict(
    {
      name: dict(
        kind=kind,
        every="1 epochs",
        split="test",
        bank_split="train",
        k=5,
        temperature=0.1,
        batch_size=8,
      )
    }
  )
  with pytest.raises(
    evaluators.ConfigError,
    match=f"config.evaluators.{name}.kind='{kind}': must be an evaluator "
    "that needs no labels: dataset 'photos' has none",
  ):
    evaluators.check_config(evaluators_config, _Unlabeled(), num_devices=8)


class _Labelled:
  """A data source with 10 classes and the splits 'train' (1000 images) and 'test' (100)."""

  name, num_classes = "digits", 10
  sizes = {"train": 1000, "test": 100}

  def num_examples(self, split, field):
    if split not in self.sizes:
      raise evaluators.ConfigError(field, split, f"one of {sorted(self.sizes)}")
    return self.sizes[split]


def _evaluator(kind, changes=None):
  """config.evaluators with one evaluator 'e' of `kind` that can run, then `changes`."""
  fields = {
    "knn": dict(split="test", bank_split="train", k=5, temperature=0.1),
    "classifier": dict(split="test"),
  }[kind]
  return ml_collections.ConfigDict(
    {"e": {**fields, "kind": kind, "every": "1 epochs", "batch_size": 8, **(changes or {})}}
  )


@pytest.mark.parametrize("kind", sorted(evaluators.KINDS))
def test_every_kind_checks_its_own_config_and_passes_a_good_one(kind):
  # The evaluator contract: each kind's own check, with one signature.
  check = evaluators.KINDS[kind].check_config
  assert list(inspect.signature(check).parameters) == ["field", "cfg", "source"]
  evaluators.check_config(_evaluator(kind), _Labelled(), num_devices=8)


@pytest.mark.parametrize(
  "kind,changes,line",
  [
    (
      "knn",
      {"kind": "svm"},
      "config.evaluators.e.kind='svm': must be one of ['classifier', 'knn']",
    ),
    (
      "classifier",
      {"batch_size": 12},
      "config.evaluators.e.batch_size=12: must be a positive multiple of the number of devices (8)",
    ),
    ("classifier", {"split": "val"}, "config.evaluators.e.split='val': must be one of"),
    ("knn", {"bank_split": "val"}, "config.evaluators.e.bank_split='val': must be one of"),
    ("knn", {"k": 0}, "config.evaluators.e.k=0: must be an integer > 0"),
    ("knn", {"temperature": 0.0}, "config.evaluators.e.temperature=0.0: must be > 0"),
  ],
)
def test_a_bad_evaluator_config_is_one_line_naming_field_value_and_allowed(kind, changes, line):
  with pytest.raises(evaluators.ConfigError) as error:
    evaluators.check_config(_evaluator(kind, changes), _Labelled(), num_devices=8)
  assert str(error.value).startswith(line) and "\n" not in str(error.value)
