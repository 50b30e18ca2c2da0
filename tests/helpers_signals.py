"""Children that take Ctrl-C whatever started the tests.

A shell starts a background job (`make test &`, a CI runner without job control) with SIGINT
ignored, and Python keeps an ignored SIGINT ignored: a child started from such a run never
sees the Ctrl-C a test sends it. The tests that send one start their child with SIGINT at its
default, as a terminal would.
"""

import signal
import subprocess
from typing import Any


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_taking_ctrl_c(command: list[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen` of a child whose SIGINT is at its default."""
    return subprocess.Popen(command, preexec_fn=_default_sigint, **kwargs)
