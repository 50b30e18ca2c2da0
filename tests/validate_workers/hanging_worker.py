"""A rank that never finishes, and leaves a grandchild in a session of its own (as torchrun's
workers are): the runner must stop both when the case times out."""

import subprocess
import sys
import time

subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
time.sleep(600)
