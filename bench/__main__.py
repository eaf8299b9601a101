"""`python -m splitserve.bench ...` is `splitserve bench ...`."""

import sys

from splitserve.bench.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
