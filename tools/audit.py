"""Graph-break / recompile audit; see `compiled_loss.audit_tool` (`compiled-loss-audit`)."""

import sys

from compiled_loss.audit_tool import main

if __name__ == "__main__":
    sys.exit(main())
