"""Seed module `nemo_rl.algorithms.loss.wrapper`: this name is `compiled_loss.nemo_rl.wrapper`
itself (one module object, so a name patched through either path is patched for both)."""

import sys

from compiled_loss.nemo_rl import wrapper

sys.modules[__name__] = wrapper
