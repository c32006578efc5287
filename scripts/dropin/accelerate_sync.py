"""Accelerate's own gradient-synchronization checks (accelerate/test_utils/scripts/test_sync.py,
shipped with the package), including the accumulation loops its main() runs on GPUs only.

    env PYTHONPATH=scripts/dropin/accelerate_swap ACCELERATE_USE_CPU=true \
        torchrun --standalone --nproc-per-node 2 scripts/dropin/accelerate_sync.py

accelerate_swap/sitecustomize.py puts dpscale's Accelerator in place of accelerate's in every
process before test_sync imports it (DPSCALE_SWAP=0 runs the same on accelerate's own).
"""

import itertools
import os
import sys

import accelerate
from accelerate.state import PartialState

sys.path.insert(0, os.path.join(os.path.dirname(accelerate.__file__), "test_utils", "scripts"))
import test_sync  # noqa: E402  accelerate's file, found on the path above

accelerator = test_sync.Accelerator()
test_sync.test_dataloader_break()
test_sync.test_distributed_sync(accelerator)
test_sync.test_distributed_sync_multiple_fwd(accelerator)
checks = 3
for split, dispatch, each in itertools.product([True, False], repeat=3):
    test_sync.test_gradient_accumulation(split, dispatch, each)
    test_sync.test_gradient_accumulation_with_opt_and_scheduler(split, dispatch, each)
    checks += 2
if PartialState().process_index == 0:
    print(f"accelerate test_sync: {checks} checks passed with {type(accelerator).__module__}.Accelerator")
accelerator.state.destroy_process_group()
