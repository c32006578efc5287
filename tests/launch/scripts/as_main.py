"""A script that reports, as JSON on stdout, what a script under `dpscale run` may rely on of its
process (tests/launch/test_forked_scripts.py runs it forked from the server and started afresh)."""

import atexit
import json
import multiprocessing
import os
import pickle
import sys

import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    """Defined in the script: DataLoader's worker processes and a spawned pool must find it."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(float(i * i))


def double(x):
    return 2 * Squares()[x].item()


def _end(rank):
    print(f"atexit {rank}", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    rank = os.environ["RANK"]
    atexit.register(_end, rank)
    try:
        if mode == "report":
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                spawned = pool.map(double, [1, 2])
            batches = [b.tolist() for b in DataLoader(Squares(), batch_size=2, num_workers=1)]
            report = {
                "argv": sys.argv,
                "path0": sys.path[0],
                "file": __file__,
                "name": __name__,
                "rank": rank,
                "world": os.environ["WORLD_SIZE"],
                "launcher_var": os.environ.get("AS_MAIN_VAR"),
                "threads": torch.get_num_threads(),
                "omp": os.environ.get("OMP_NUM_THREADS"),
                "start_method": multiprocessing.get_start_method(),
                "process": multiprocessing.current_process().name,
                "parent": multiprocessing.parent_process() is None,
                "pickled": type(pickle.loads(pickle.dumps(Squares()))).__module__,
                "spawned": spawned,
                "batches": batches,
                "torchs_ddp": torch.nn.parallel.DistributedDataParallel.__module__.startswith("torch."),
                "preloaded": {m: m in sys.modules for m in ("torch._dynamo", "dpscale.train.trainer")},
            }
            # one write of the whole line: the ranks share the terminal
            os.write(1, (json.dumps(report) + "\n").encode())
        elif mode == "raise":
            raise RuntimeError("the script's own error")
        elif mode == "exit":
            sys.exit(int(sys.argv[2]) if sys.argv[2].lstrip("-").isdigit() else sys.argv[2])
        elif mode == "interrupt":
            raise KeyboardInterrupt
        elif mode == "os_exit":
            print("leaving", flush=True)
            os._exit(int(sys.argv[2]))
    finally:
        print(f"finally {rank}", flush=True)
