"""`python -m zsim`: the command line."""

import sys

from zsim.cli import main

sys.exit(main())
