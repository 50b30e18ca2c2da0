"""The real train worker, except that rank 1 aborts after the results are written (as gloo's
threads sometimes make a rank do on its way out)."""

import os
import sys

from zsim.validate import train_worker

code = train_worker.main(sys.argv[1:])
if os.environ.get("RANK") == "1":
    os.abort()
sys.exit(code)
