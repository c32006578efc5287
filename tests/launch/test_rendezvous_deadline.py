"""Every rendezvous store call of a multi-host job ends within read_timeout.

torch's store client waits in a plain `recv` for a `compare_set` or `get` reply; with the link to
the store's host cut, that recv never returns, and torch's agent on the cut-off host hung for as
long as it lived. The store here never replies, as a store behind a pulled cable does.
"""

import threading
import time

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from dpscale.launch.rendezvous import _MultiHostBackend
from support.timing import cpu_baseline_s


class _SilentStore:
    def __init__(self):
        self.release = threading.Event()

    def compare_set(self, *args):
        self.release.wait(60)  # no answer, no reset
        return b""

    get = compare_set


def test_a_store_that_never_answers_fails_the_call_within_read_timeout():
    store = _SilentStore()
    slack_s = 300 * cpu_baseline_s()
    start = time.monotonic()
    try:
        # torch's constructor calls compare_set; the error names the store's host for torchrun users
        with pytest.raises(
            RendezvousConnectionError, match="store at 10.0.0.1:29400 did not answer within 1 s"
        ):
            _MultiHostBackend(store, "job", read_timeout_s=1, endpoint="10.0.0.1:29400")
        assert time.monotonic() - start < 1 + slack_s
    finally:
        store.release.set()  # let the abandoned call's thread end
