"""`python -m splitserve.cluster.cli ...` is the `splitserve` command."""

import sys

from splitserve.cluster.cli.main import main

sys.exit(main())
