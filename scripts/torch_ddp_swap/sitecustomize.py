"""Swap dpscale's engine in for torch's DistributedDataParallel in every Python process.

Put this folder first on PYTHONPATH to run code written for torch DDP (torch's own test files,
a user's script) on dpscale's engine unchanged: Python imports `sitecustomize` at start-up, before
the code under test imports torch.nn.parallel, and spawned workers inherit PYTHONPATH. Set
DPSCALE_SWAP=0 to run the same command on torch's own class. See docs/torch-ddp-tests.md.
"""

import os

if os.environ.get("DPSCALE_SWAP", "1") != "0":
    import torch.nn.parallel
    import torch.nn.parallel.distributed

    from dpscale import DistributedDataParallel

    torch.nn.parallel.DistributedDataParallel = DistributedDataParallel
    torch.nn.parallel.distributed.DistributedDataParallel = DistributedDataParallel
