"""Seed module `nemo_rl.algorithms.loss.utils`: this name is `compiled_loss.nemo_rl.utils`
itself (one module object, so a name patched through either path is patched for both)."""

import sys

from compiled_loss.nemo_rl import utils

sys.modules[__name__] = utils
