"""Session settings for the whole suite: one intra-op thread per test process.

The suite runs as two pytest-xdist workers on 2 cores (`python -m pytest -n 2`, README);
each worker — and each process a test starts (torchrun ranks, spawned process groups,
which inherit the environment) — computes on one thread, so the workers do not
oversubscribe the cores (idle OpenMP threads spin before they sleep). The tensors here are
small: one thread costs a single process nothing measurable.
"""

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
