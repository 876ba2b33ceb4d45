"""`python -m moekv_ref COMMAND ...`: the command line lives in moekv_ref/apps/cli.py."""

import sys

from .apps.cli import main

sys.exit(main())
