"""`python -m convert SRC OUT [--dtype ...] [--format sdx]` (see convert/cli.py)."""

import sys

from convert.cli import main

sys.exit(main())
