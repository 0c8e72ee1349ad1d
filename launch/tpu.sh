#!/usr/bin/env bash
# Launches a pretraining job on every worker of a Cloud TPU VM pod.
#
#   launch/tpu.sh TPU_NAME ZONE --config=configs/simclr_imagenet.py --workdir=gs://BUCKET/run1 \
#       [--config.batch_size=8192 ...]
#
# Copies this checkout to every worker, installs it, then starts the same
# command on all of them at once. --distributed makes each process call
# jax.distributed.initialize(), which finds its peers on Cloud TPU by itself.
# Each process reads its own part of the data; only process 0 writes metrics;
# all of them write the (GCS) checkpoints together. Relaunching with the same
# --workdir resumes from the latest checkpoint.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  echo "usage: $0 TPU_NAME ZONE --config=configs/X.py[:variant] --workdir=DIR [--config.FIELD=VALUE ...]" >&2
  exit 2
fi
tpu="$1"; zone="$2"; shift 2
args=$(printf ' %q' "$@")
repo=$(cd "$(dirname "$0")/.." && pwd)

gcloud compute tpus tpu-vm scp --recurse "$repo" "$tpu:~/contrastive_jax" --zone="$zone" --worker=all
gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" --worker=all --command="
  set -e
  cd ~/contrastive_jax
  pip install -q -e . 'jax[tpu]==0.10.2'
  python -m contrastive_jax.main --distributed$args"
