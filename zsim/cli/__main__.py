"""`python -m zsim.cli`: the zsim command."""

import sys

from zsim.cli import main

sys.exit(main())
