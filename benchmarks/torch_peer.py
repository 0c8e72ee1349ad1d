"""Each method's pretraining step beside a PyTorch eager peer, side by side in one process.

  python benchmarks/torch_peer.py --config=configs/simclr_cifar10.py:runlocal

Needs torch (the [torch] extra); SimCLR, MoCo v2, BYOL and MoCo v3 configs of ResNets with
BasicBlocks (ResNet-10/18/34). Prints a table. Each row is timed on one fixed batch after a
warm-up call, in interleaved rounds (every row once per round, the median round reported),
so that a change of the machine's load falls on every row alike:

  project step     the job's jitted train step: the on-device colour augmentation of both
                   views, the method's networks and loss, the config's optimizer, the
                   online probe;
  augmentation     the on-device augmentation of both views alone;
  JAX peer, LARS   (SimCLR) the project's encoder, projection head and nt_xent on float32
                   views already augmented, with the config's optimizer;
  JAX peer, SGD    (SimCLR) the same with SGD, momentum 0.9: the PyTorch peer's work;
  PyTorch peer     the same networks (torch_peer's docstring says what each method's
                   does), eager, channels-first float32, SGD with momentum 0.9.

The last column divides each row's seconds by the PyTorch peer's. The online probe's cost
is about the project step's minus the augmentation's and the JAX LARS peer's.
"""

import copy
import functools
import os
import statistics
import sys
import time

# Time the package this script sits in, not another installed copy of it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from contrastive_jax.core import runtime

if __name__ == "__main__":
  runtime.setup()  # Every process setting first, before the imports below (core/runtime.py).

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax
import torch
from torch import nn

# torch's compiler stack before the project's modules import TensorFlow: torch.optim imports
# triton lazily, and triton's libraries segfault when they load after TensorFlow's.
import torch._dynamo  # noqa: F401  pylint: disable=unused-import

from benchmarks import common
from contrastive_jax import models
from contrastive_jax.data import augment
from contrastive_jax.methods import common as method_common
from contrastive_jax.methods import optim
from contrastive_jax.methods import pretraining
from contrastive_jax.methods import simclr
from contrastive_jax.models import heads
from contrastive_jax.models import resnet

METHODS = ("simclr", "moco", "byol", "mocov3")
_CONFIG = config_flags.DEFINE_config_file("config", None, "A SimCLR ResNet-10/18/34 config.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per row and round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds; the median is reported.")


def check_config(config):
  """Raises ValueError unless config is one of METHODS on a ResNet with BasicBlocks."""
  if config.method not in METHODS:
    raise ValueError(f"method: {config.method!r}; allowed: {METHODS}")
  spec = resnet.SPECS.get(config.model.name)
  if spec is None or spec[0] != "basic":
    raise ValueError(
      f"model.name: {config.model.name!r}; allowed: a ResNet of BasicBlocks "
      f"({[n for n, s in resnet.SPECS.items() if s[0] == 'basic']})"
    )


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


def torch_resnet(model_config):
  """(module, width of h): the config's ResNet of BasicBlocks in PyTorch, NCHW float32.

  The same depth, widths, stem and projection shortcuts as models/resnet.py; symmetric
  padding (the FLOPs are the same under every padding rule).
  """

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

  base = max(1, round(64 * model_config.width))
  if model_config.stem == "cifar":
    layers = [nn.Conv2d(3, base, 3, 1, 1, bias=False), nn.BatchNorm2d(base), nn.ReLU()]
  else:
    layers = [nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU()]
    layers.append(nn.MaxPool2d(3, 2, 1))
  cin = base
  stage_projection = model_config.get("stage_projection", False)
  for i, blocks in enumerate(resnet.SPECS[model_config.name][1]):
    for j in range(blocks):
      stride = 2 if i > 0 and j == 0 else 1
      cout = base * 2**i
      project = (stage_projection and j == 0) or stride > 1 or cin != cout
      layers.append(Block(cin, cout, stride, project))
      cin = cout
  return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten()), cin


def torch_mlp(mlp_config, width: int):
  """(module, output width): the config's MLP head (models.build_mlp's layers) in PyTorch."""
  layers = []
  for hidden in mlp_config.hidden_dims:
    layers += [nn.Linear(width, hidden, bias=not mlp_config.use_bn)]
    layers += [nn.BatchNorm1d(hidden)] if mlp_config.use_bn else []
    layers += [nn.ReLU()]
    width = hidden
  layers.append(nn.Linear(width, mlp_config.out_dim, bias=not mlp_config.get("final_bn", False)))
  if mlp_config.get("final_bn", False):
    layers.append(nn.BatchNorm1d(mlp_config.out_dim))
  return nn.Sequential(*layers), mlp_config.out_dim


def torch_networks(config):
  """(online, target or None): encoder, projection head and (BYOL, MoCo v3) predictor; the
  momentum encoder or target network a copy of the online encoder and head."""
  encoder, width = torch_resnet(config.model)
  projector, width = torch_mlp(config.projector, width)
  online = nn.Sequential(encoder, projector)
  target = None if config.method == "simclr" else copy.deepcopy(online)
  if config.method in ("byol", "mocov3"):
    online.append(torch_mlp(config.predictor, width)[0])
  return online, target


def _ema(target, online, momentum: float):
  """target <- momentum * target + (1 - momentum) * online, parameter by parameter."""
  with torch.no_grad():
    for t, o in zip(target.parameters(), online[: len(target)].parameters()):
      t.lerp_(o, 1 - momentum)


def _info_nce(q, k, temperature: float):
  """MoCo v3's symmetric term: cross-entropy of q's similarities to k, positives on the
  diagonal, times 2 * temperature (MoCo v3 Algorithm 1)."""
  logits = q @ k.T / temperature
  return nn.functional.cross_entropy(logits, torch.arange(len(q))) * 2 * temperature


def torch_peer(config):
  """step(v1, v2) -> loss: the method's PyTorch peer, eager, views NCHW float32 [B, 3, S, S].

  SimCLR: NT-Xent over both views in one forward pass. MoCo v2: InfoNCE of view 1's
  queries against view 2's keys and a queue of config.moco.queue_size keys, the momentum
  encoder an EMA, plain BN (no shuffle). BYOL: each network's two views in two passes, the
  symmetric regression loss, the target an EMA. MoCo v3: the same passes, the symmetric
  InfoNCE within the batch. Every update is SGD with momentum 0.9.
  """
  online, target = torch_networks(config)
  opt = torch.optim.SGD(online.parameters(), lr=0.1, momentum=0.9)
  normalize = functools.partial(nn.functional.normalize, dim=1)
  momentum = config.moco.momentum if "moco" in config else config.get("byol", {}).get("tau_base")
  if config.method == "moco":
    queue = normalize(torch.randn(config.moco.queue_size, config.projector.out_dim))

  def loss_fn(v1, v2):
    nonlocal queue
    t = config.get("temperature", 1.0)
    if config.method == "simclr":
      z = normalize(online(torch.cat([v1, v2])))
      n = len(v1)
      logits = (z @ z.T / t).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
      positives = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
      return nn.functional.cross_entropy(logits, positives, reduction="sum") / n
    _ema(target, online, momentum)
    with torch.no_grad():
      k1, k2 = normalize(target(v1)), normalize(target(v2))
    if config.method == "moco":
      q = normalize(online(v1))
      logits = torch.cat([(q * k2).sum(1, keepdim=True), q @ queue.T], dim=1) / t
      queue = torch.cat([k2, queue[: -len(k2)]])
      return nn.functional.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long))
    p1, p2 = normalize(online(v1)), normalize(online(v2))
    if config.method == "byol":
      return (4 - 2 * (p1 * k2).sum(1) - 2 * (p2 * k1).sum(1)).mean()
    return _info_nce(p1, k2, t) + _info_nce(p2, k1, t)

  def step(v1, v2):
    loss = loss_fn(v1, v2)
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


def jax_timer(step, state, batch, steps: int):
  """timer() -> seconds per call of jitted step(state, batch) -> (state, out) over `steps`
  calls, each on the state the last returned; compiles with one call first."""
  state, out = step(state, batch)
  jax.block_until_ready(out)
  holder = [state]

  def timer():
    seconds, holder[0] = common.seconds_per_step(step, holder[0], batch, steps)
    return seconds

  return timer


def eager_timer(fn, steps: int):
  """timer() -> seconds per call of fn() over `steps` calls; calls it once first."""
  fn()

  def timer():
    start = time.perf_counter()
    for _ in range(steps):
      fn()
    return (time.perf_counter() - start) / steps

  return timer


def main(_):
  config = _CONFIG.value
  check_config(config)
  steps = _STEPS.value
  b, s = config.batch_size, config.image_size
  print(
    f"{config.method}: {jax.device_count()} {jax.devices()[0].platform} device(s), "
    f"torch {torch.__version__} with {torch.get_num_threads()} threads; batch {b} "
    f"({2 * b} views of {s} px), {steps} steps x {_ROUNDS.value} rounds, "
    f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
  )
  run, state, batch = common.step_setup(config)
  timers = {"project step": jax_timer(run.train_step, state, batch, steps)}

  view_settings = pretraining.views(config)

  @jax.jit
  def augment_step(key, images):
    key, *keys = jax.random.split(key, 3)
    return key, [augment.augment_batch(images[:, v], keys[v], view_settings[v]) for v in range(2)]

  images = jax.device_put(np.asarray(batch["image"]))  # On one device, for augment's vmap.
  timers["augmentation"] = jax_timer(augment_step, jax.random.key(0), images, steps)

  views = np.random.default_rng(1).random((2, b, s, s, 3), np.float32)
  if config.method == "simclr":
    jax_views = jax.device_put(views.reshape(2 * b, s, s, 3))
    for name, tx in (
      ("LARS", optim.build_optimizer(config.optimizer, run.schedule)),
      ("SGD", optax.sgd(0.1, momentum=0.9)),
    ):
      timers[f"JAX peer, {name}"] = jax_timer(*jax_peer(config, tx), jax_views, steps)
  torch_step = torch_peer(config)
  v1, v2 = (torch.from_numpy(v.transpose(0, 3, 1, 2).copy()) for v in views)
  timers["PyTorch peer"] = eager_timer(lambda: torch_step(v1, v2), steps)

  seconds = median_seconds(timers, _ROUNDS.value)
  print("| row | s/step | views/s | / PyTorch peer |")
  print("|---|---|---|---|")
  for name, value in seconds.items():
    print(f"| {name} | {value:.3f} | {2 * b / value:.0f} | {value / seconds['PyTorch peer']:.2f} |")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
