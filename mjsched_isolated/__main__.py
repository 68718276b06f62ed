"""``python -m mjsched_isolated``: the CLI.

The guard matters: worker children are spawned, and spawn re-imports the parent's main module.
"""

import sys

from mjsched_isolated.cli import main

if __name__ == "__main__":
    sys.exit(main())
