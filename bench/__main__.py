"""`python -m bench`: the bench's command line (bench/cli.py)."""

import sys

from bench.cli import main

sys.exit(main())
