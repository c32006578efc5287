"""`python -m dpscale.launch.agent TORCHRUN-ARGS`: torchrun, with dpscale's single-host rendezvous known.

torchrun finds other rendezvous backends through the `torchrun.handlers` entry point (how
`dpscale-c10d` reaches it, torchrun_plugin.py). `dpscale-loopback`, the single-host backend whose
stores listen on 127.0.0.1 only (rendezvous.py), is registered here in process instead: it is
dpscale's own way to run one host, not a backend for users to name. `dpscale run` and `scale`
start this module (through process_life.guarded_module) where torchrun's `--standalone` would
listen on every interface.
"""

from __future__ import annotations

from torch.distributed.run import main

from dpscale.launch import rendezvous

if __name__ == "__main__":
    rendezvous.register()
    main()
