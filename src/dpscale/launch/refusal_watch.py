"""Bad input on one rank ends every rank of the job at once, on every host, as bad input.

A worker refused by its input (a ConfigError: a checkpoint that does not fit, user code that
raised) exits 0 with a record for its launcher (protocol.py), so that the agent does not restart
it. When only some ranks refuse, the others wait in a collective for a rank that is gone: with
shared memory for as long as the collective timeout, across hosts until the rejoin timeout, and
then they fail, and their agents restart them. So the refusing rank first says so in the
group's store (one key per attempt), and every worker watches that key: a worker that sees it
writes the same refusal for its own launcher and leaves with exit 0 too. Every host's launcher
then prints the one line and exits 2, within about a second, and nothing is restarted.

A worker whose collective broke before its watch looked (the refusing rank's exit reset its
sockets) reads the key on the way out and is refused the same way (`PeerRefused`).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from types import TracebackType
from typing import Any

from dpscale.comm.attempt import attempt_id, within
from dpscale.errors import ConfigError, UserCodeError
from dpscale.launch import torch_private
from dpscale.launch.fork_start import forked_worker
from dpscale.launch.process_life import exit_now
from dpscale.launch.protocol import WorkerFailure

KEY = "dpscale/refused"
USER_EXIT = "the task's code, during training,"
"""What a refusal names when the user's code called sys.exit in a worker."""
POLL_S = 0.25
"""How often a worker looks: the job ends within about this long of a refusal."""
LINGER_S = 4 * POLL_S
"""How long the refusing rank stays after saying so: the others' watches see the key before its
exit breaks their collectives (those that do not still read it on the way out)."""
_STORE_CALL_S = 5.0  # a store that does not answer (its host is gone): the job fails otherwise
_CONNECT_S = 60  # the store served this worker's group a moment ago; a loaded host may be slow


def store_for_attempt() -> Any:
    """A client of its own to the job's store (MASTER_ADDR:MASTER_PORT, where the workers' group
    meets), under this attempt's prefix: a call stuck on a cut link then blocks the watch only,
    not the trainer's own calls through the group's client (a client serves one call at a time)."""
    import torch.distributed as dist

    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=_CONNECT_S),
    )
    return dist.PrefixStore(f"dpscale/{attempt_id()}/", client)


class PeerRefused(UserCodeError):
    """Another rank of this attempt was refused by its input; the message is that rank's."""


class RefusalWatch:
    """While in use: watch `store` for another rank's refusal; on leaving with a ConfigError,
    announce this rank's. `store`: a client of the job's store for this watch alone, under a
    prefix of this attempt (`store_for_attempt`); `failures_dir`: where this host's launcher reads
    worker records."""

    def __init__(self, store: Any, rank: int, failures_dir: str):
        self._client, self._rank, self._dir = store, rank, failures_dir
        self._done = threading.Event()
        self._last_answer = time.monotonic()  # when the store last answered the watch
        self._thread = threading.Thread(target=self._watch, name="dpscale-refusal-watch", daemon=True)

    def __enter__(self) -> RefusalWatch:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()
        if self._thread.is_alive():  # a poll in flight ends at once on a live store
            self._thread.join(2 * POLL_S)
        if isinstance(error, SystemExit):  # the user's code called sys.exit: refused as well
            self.announce(UserCodeError.from_exception(USER_EXIT, error))
        elif isinstance(error, ConfigError):
            self.announce(error)
        elif isinstance(error, Exception) and self._store_answers() and (refused := self.peer_refusal()):
            raise PeerRefused(refused["bad_input"], refused["user_traceback"]) from error

    def _store_answers(self) -> bool:
        # only ask a store that answered the watch lately: a failure because its host is cut off
        # must not wait here on top of the collective timeout (the partition's bounds)
        return time.monotonic() - self._last_answer < 2 * POLL_S + 1

    def announce(self, error: ConfigError) -> None:
        """Tell the other ranks; stay LINGER_S so their watches see it before this rank exits."""
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        trace = error.user_traceback if isinstance(error, UserCodeError) else ""
        record = json.dumps({"rank": self._rank, "bad_input": message, "user_traceback": trace})
        if within(_STORE_CALL_S, lambda: self._client.set(KEY, record) or True, False):
            time.sleep(LINGER_S)

    def peer_refusal(self) -> dict | None:
        """Another rank's refusal record, if one announced it; None otherwise (or no store answer)."""
        return within(_STORE_CALL_S, self._lookup, None)

    def _lookup(self) -> dict | None:
        if not self._client.check([KEY]):
            return None
        try:
            record = json.loads(self._client.get(KEY))
        except ValueError:
            return None
        if not isinstance(record, dict) or record.get("rank") == self._rank:
            return None
        return record

    def _watch(self) -> None:
        while not self._done.wait(POLL_S):
            try:
                # unbounded: the store is this watch's own client, so a call stuck on a cut link
                # holds up nothing else (and no thread per poll piles up behind it)
                refused = self._lookup()
            except Exception:  # the store is gone: the job's own failure handling takes over
                return
            self._last_answer = time.monotonic()
            if refused is None or self._done.is_set():
                continue
            # this rank is stuck in (or heading for) a collective with a rank that left: leave too,
            # as refused, so that the agent does not restart the job (module docstring)
            WorkerFailure(
                rank=self._rank,
                pid=os.getpid(),
                silent_ranks=[],
                bad_input=str(refused.get("bad_input", "")) or "another rank was refused by its input",
                user_traceback=str(refused.get("user_traceback", "")),
            ).write(self._dir)
            if forked_worker():  # the agent waits for the value a returning worker hands back
                torch_private.hand_back_result(0)
            exit_now(0)
