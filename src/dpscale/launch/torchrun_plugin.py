"""The `torchrun.handlers` entry point: `torchrun --rdzv-backend dpscale-c10d` (see rendezvous.py).

torch loads entry points while `torch.distributed.elastic.rendezvous` is still being imported,
which may be in the middle of importing dpscale itself (dpscale's rendezvous module imports
torch's). This module therefore imports nothing at load time; the handler is built on first use.
"""


def torchrun_handler():
    """What torch's registry calls at import: returns the creator of the handler."""

    def create(params):
        from dpscale.launch.rendezvous import create_multi_host_handler

        return create_multi_host_handler(params)

    return create
