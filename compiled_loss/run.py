"""`python -m compiled_loss.run [overrides]` — see `compiled_loss.app.run`."""

import sys

from compiled_loss.app.cli import run
from compiled_loss.app.run import main

if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
