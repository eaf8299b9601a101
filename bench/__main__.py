"""`python -m bench ...` is `splitserve bench ...`."""
import sys

from bench.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
