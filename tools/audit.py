"""Graph-break / recompile audit; see `compiled_loss.audit.cli` (`compiled-loss-audit`)."""

import sys

from compiled_loss.audit.cli import main

if __name__ == "__main__":
    sys.exit(main())
