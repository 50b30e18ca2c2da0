"""The CPU ranks' allocator environment (zsim.testbed.procs.CPU_ALLOCATOR_ENV) makes glibc
keep freed memory as the GPU caching allocator does: after the first calls, a gathered output
smaller than a thread arena's 64 MiB heap comes mostly from pages already touched (a new heap
still opens now and then). A larger one is mapped fresh on every call, which is what the
simulator charges (`LocalWork.fresh_above_bytes`, 63 MiB in the CPU fabric preset)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zsim.inputs import presets
from zsim.testbed.procs import CPU_ALLOCATOR_ENV

pytest.importorskip("torch")
WORKER = Path(__file__).parent / "workers" / "gather_faults.py"
PAGE = os.sysconf("SC_PAGE_SIZE")


def test_gathered_outputs_fault_in_once_below_a_heap_and_on_every_call_above():
    # 34 MiB fits a thread arena's 64 MiB heap (which glibc 2.36 unmaps once emptied, but for
    # the top pad); 72 MiB does not, so the arena maps it fresh on every call
    sizes = (34, 72)
    env = dict(os.environ, OMP_NUM_THREADS="1", **CPU_ALLOCATOR_ENV)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    argv += ["--standalone", str(WORKER), *map(str, sizes)]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    faults = json.loads(run.stdout.strip().splitlines()[-1])
    # the first calls fill the arenas' heaps (up to 5 seen here)
    later = {mib: faults[str(mib)][6:] for mib in sizes}
    pages = {mib: mib * 2**20 // PAGE for mib in sizes}  # a fault-in of the whole output
    faulted = [n > pages[34] // 2 for n in later[34]]
    assert sum(faulted) < len(faulted) / 2, faults  # seen: 0-2 of 6 (without the pad: most)
    assert min(later[72]) > pages[72] * 0.9, faults  # the whole output, every call
    assert presets.fabric("cpu").local_work.fresh_above_bytes == pytest.approx(63 * 2**20)
