"""Seed module `nemo_rl.algorithms.loss.loss_functions`: this name is `compiled_loss.nemo_rl.loss_functions`
itself (one module object, so a name patched through either path is patched for both)."""

import sys

from compiled_loss.nemo_rl import loss_functions

sys.modules[__name__] = loss_functions
