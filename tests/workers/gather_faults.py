"""A rank of tests/test_cpu_allocator.py: the page faults of each all_gather_into_tensor call
(whole process: gloo's worker threads allocate its output), printed by rank 0 as JSON."""

import json
import resource
import sys

import torch
import torch.distributed as dist


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = {}
    for mib in map(int, sys.argv[1:]):
        n = mib * 2**20 // 4
        flat, part = torch.empty(n), torch.ones(n // 2)
        calls = []
        for _ in range(12):
            dist.barrier()
            before = faults()
            dist.all_gather_into_tensor(flat, part)
            calls.append(faults() - before)
        out[mib] = calls
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
