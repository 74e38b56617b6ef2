"""``python -m mixquant.cli``: the `mixquant` command."""

import sys

from mixquant.cli.parser import main

if __name__ == "__main__":
    sys.exit(main())
