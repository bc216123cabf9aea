"""`python -m compiled_loss.run [overrides]` — see `compiled_loss.app.run`."""

import sys

from compiled_loss.app.run import main

if __name__ == "__main__":
    sys.exit(main())
