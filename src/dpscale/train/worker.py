"""`torchrun ... -m dpscale.train.worker --workload digits ...`: the training worker under plain torchrun.

Takes the same flags as `dpscale train` except the launcher's own (--nproc, --max-restarts);
rank 0 prints the result as one JSON line when --json is given. Under `torchrun --nnodes MIN:MAX`
the world size may change between restarts; the trainer then keeps the global batch (see
docs/fault-tolerance.md). Rank 0 warns when the rendezvous address (MASTER_ADDR) is not loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..cli_fields import add_dataclass_arguments, dataclass_kwargs
from .config import TrainConfig
from .launch import rendezvous_warning, run_worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpscale.train.worker", description=__doc__.splitlines()[0]
    )
    add_dataclass_arguments(parser, TrainConfig)
    parser.add_argument("--json", action="store_true", help="rank 0 prints the result as a JSON line")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per worker")
    args = parser.parse_args(argv)
    try:
        fields = dataclass_kwargs(args, TrainConfig)
        if fields.get("task") is None and fields.get("workload") is None:
            fields["workload"] = "digits"
        cfg = TrainConfig(**fields)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    warning = rendezvous_warning(os.environ.get("MASTER_ADDR"))
    if warning and int(os.environ.get("RANK", "0")) == 0:
        print(warning, file=sys.stderr, flush=True)
    result = run_worker(cfg.to_dict(), args.threads)
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
