"""What the training jobs share: the runner loop, the evaluators, restoring a pretrained encoder
and the downstream jobs' task."""
