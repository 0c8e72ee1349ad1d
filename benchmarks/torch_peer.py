"""The SimCLR step beside a PyTorch eager peer, side by side in one process; prints a table.

  python benchmarks/torch_peer.py --config=configs/simclr_cifar10.py:runlocal

Needs torch (the [torch] extra). Rows, each timed on the same fixed batch after a
warm-up step, in interleaved rounds (every row once per round, the median round
reported) so that a change of the machine's load falls on every row alike:

  project step     the job's jitted train step: on-device colour augmentation of
                   both views, encoder and projection head, NT-Xent over the global
                   batch, the config's optimizer (LARS), the online probe;
  augmentation     the on-device augmentation of both views alone;
  JAX peer, LARS   the project's encoder, projection head and nt_xent on float32
                   views already augmented, with the config's optimizer;
  JAX peer, SGD    the same with SGD, momentum 0.9: the peer's work exactly;
  PyTorch peer     the same network (ResNet with the config's depth, width, stem and
                   projection shortcuts; the same MLP head with BN), NT-Xent and
                   torch.optim.SGD(momentum=0.9), eager, channels-first float32.

The last column divides each row's seconds by the PyTorch peer's. The online probe's
cost is about the project step's minus the augmentation's and the JAX LARS peer's.
Only ResNet configs with BasicBlocks (ResNet-18/34) have a PyTorch peer here.
"""

import os
import statistics
import sys
import time

# Time the package this script sits in, not another installed copy of it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax
import torch

# torch's compiler stack before the project's modules import TensorFlow: torch.optim imports
# triton lazily, and triton's libraries segfault when they load after TensorFlow's.
import torch._dynamo  # noqa: F401  pylint: disable=unused-import

from benchmarks import common
from contrastive_jax import models
from contrastive_jax.data import augment
from contrastive_jax.jobs import pretrain
from contrastive_jax.methods import common as method_common
from contrastive_jax.methods import optim
from contrastive_jax.methods import simclr
from contrastive_jax.models import heads
from contrastive_jax.models import resnet

_CONFIG = config_flags.DEFINE_config_file("config", None, "A SimCLR ResNet-18/34 config.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per row and round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds; the median is reported.")


def check_config(config):
  """Raises ValueError unless config is SimCLR on a ResNet with BasicBlocks."""
  if config.method != "simclr":
    raise ValueError(f"method: {config.method!r}; this benchmark times 'simclr' configs")
  spec = resnet.SPECS.get(config.model.name)
  if spec is None or spec[0] != "basic":
    raise ValueError(
      f"model.name: {config.model.name!r}; allowed: a ResNet of BasicBlocks "
      f"({[n for n, s in resnet.SPECS.items() if s[0] == 'basic']})"
    )


def run_tx(config):
  """The config's optimizer (methods/optim.py) with its schedule at a 1,000-step run."""
  schedule = optim.learning_rate_schedule(config.optimizer, config.batch_size, 100, 1000)
  return optim.build_optimizer(config.optimizer, schedule)


def jax_peer(config, tx):
  """(step, state): network, nt_xent and tx on float32 views [2B, S, S, 3], one device."""
  model = heads.ContrastiveModel(
    encoder=models.build_encoder(config.model),
    projector=models.build_mlp(config.projector, config.model.dtype),
  )
  params, batch_stats = method_common.init_variables(model, jax.random.key(0), config.image_size)

  def step(state, views):
    params, batch_stats, opt_state = state

    def loss_fn(params):
      (_, z), updates = model.apply(
        {"params": params, "batch_stats": batch_stats}, views, train=True, mutable=["batch_stats"]
      )
      z1, z2 = jnp.split(z, 2)
      loss, _ = simclr.nt_xent(z1, z2, config.temperature)
      return loss, updates["batch_stats"]

    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), batch_stats, opt_state), loss

  return jax.jit(step, donate_argnums=0), (params, batch_stats, tx.init(params))


def torch_peer(config):
  """(step, model): the PyTorch network of config, NT-Xent and SGD momentum 0.9, eager."""
  from torch import nn  # pylint: disable=g-import-not-at-top

  class Block(nn.Module):
    def __init__(self, cin, cout, stride, project):
      super().__init__()
      self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
      self.bn1 = nn.BatchNorm2d(cout)
      self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
      self.bn2 = nn.BatchNorm2d(cout)
      self.shortcut = (
        nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        if project
        else nn.Identity()
      )

    def forward(self, x):
      y = torch.relu(self.bn1(self.conv1(x)))
      return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))

  base = max(1, round(64 * config.model.width))
  if config.model.stem == "cifar":
    layers = [nn.Conv2d(3, base, 3, 1, 1, bias=False), nn.BatchNorm2d(base), nn.ReLU()]
  else:
    layers = [nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU()]
    layers.append(nn.MaxPool2d(3, 2, 1))
  cin = base
  stage_projection = config.model.get("stage_projection", False)
  for i, blocks in enumerate(resnet.SPECS[config.model.name][1]):
    for j in range(blocks):
      stride = 2 if i > 0 and j == 0 else 1
      cout = base * 2**i
      project = (stage_projection and j == 0) or stride > 1 or cin != cout
      layers.append(Block(cin, cout, stride, project))
      cin = cout
  layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
  head = []
  for width in config.projector.hidden_dims:
    head += [nn.Linear(cin, width, bias=False), nn.BatchNorm1d(width), nn.ReLU()]
    cin = width
  head += [nn.Linear(cin, config.projector.out_dim, bias=False)]
  if config.projector.get("final_bn", False):
    head.append(nn.BatchNorm1d(config.projector.out_dim))
  model = nn.Sequential(*layers, *head)
  opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  temperature = config.temperature

  def step(views):
    z = nn.functional.normalize(model(views), dim=1)
    n = z.shape[0] // 2
    logits = z @ z.T / temperature
    logits = logits.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    positives = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    loss = nn.functional.cross_entropy(logits, positives, reduction="sum") / n
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss

  return step


def median_seconds(timers, rounds: int) -> dict:
  """{name: median seconds per step over rounds}; each round calls every timer once."""
  times = {name: [] for name in timers}
  for _ in range(rounds):
    for name, timer in timers.items():
      times[name].append(timer())
  return {name: statistics.median(t) for name, t in times.items()}


def main(_):
  config = _CONFIG.value
  check_config(config)
  steps = _STEPS.value
  b, s = config.batch_size, config.image_size
  print(
    f"{jax.device_count()} {jax.devices()[0].platform} device(s), torch {torch.__version__} "
    f"with {torch.get_num_threads()} threads; batch {b} ({2 * b} views of {s} px), "
    f"{steps} steps x {_ROUNDS.value} rounds"
  )

  run, state, batch = common.step_setup(config)
  views_np = np.random.default_rng(1).random((2 * b, s, s, 3), np.float32)

  view_settings = pretrain.views(config)
  images = jax.device_put(np.asarray(batch["image"]))  # unsharded, for the vmap below

  @jax.jit
  def augment_both(key):
    keys = jax.random.split(key, 2)
    return [augment.augment_batch(images[:, v], keys[v], view_settings[v]) for v in range(2)]

  tx = optax.sgd(0.1, momentum=0.9)
  peers = {
    "LARS": jax_peer(config, run_tx(config)),
    "SGD": jax_peer(config, tx),
  }
  torch_step = torch_peer(config)
  torch_views = torch.from_numpy(views_np.transpose(0, 3, 1, 2).copy())
  jax_views = jax.device_put(views_np)

  holder = {"state": state, **{name: peer[1] for name, peer in peers.items()}}

  def time_project():
    seconds, holder["state"] = common.seconds_per_step(
      run.train_step, holder["state"], batch, steps
    )
    return seconds

  def time_augment():
    start = time.perf_counter()
    for i in range(steps):
      out = augment_both(jax.random.key(i))
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps

  def time_jax_peer(name):
    def timer():
      seconds, holder[name] = common.seconds_per_step(
        peers[name][0], holder[name], jax_views, steps
      )
      return seconds

    return timer

  def time_torch():
    start = time.perf_counter()
    for _ in range(steps):
      torch_step(torch_views)
    return (time.perf_counter() - start) / steps

  timers = {
    "project step": time_project,
    "augmentation": time_augment,
    "JAX peer, LARS": time_jax_peer("LARS"),
    "JAX peer, SGD": time_jax_peer("SGD"),
    "PyTorch peer": time_torch,
  }
  for name, peer in peers.items():  # Warm-up: compile, and the first eager step.
    holder[name], loss = peer[0](holder[name], jax_views)
    jax.block_until_ready(loss)
  holder["state"], metrics = run.train_step(holder["state"], batch)
  jax.block_until_ready((metrics, augment_both(jax.random.key(0))))
  torch_step(torch_views)

  seconds = median_seconds(timers, _ROUNDS.value)
  print("| row | s/step | views/s | / PyTorch peer |")
  print("|---|---|---|---|")
  for name, value in seconds.items():
    print(f"| {name} | {value:.3f} | {2 * b / value:.0f} | {value / seconds['PyTorch peer']:.2f} |")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
