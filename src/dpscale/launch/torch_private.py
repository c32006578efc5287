"""Every private torch attribute the launcher touches, in one place, each checked on first use.

torch's elastic agent has no public way to bind its stores to one address, to say which round a
host joined, who took part in it, or to shorten the wait for hosts that rejoin after a failure;
the launcher reaches into torch's rendezvous handler for those (rendezvous.py, lost_hosts.py).
Each such reach goes through a function here that checks, the first time, that the attribute
exists with the shape this code expects. When a torch release moves one, the launcher fails with
one line naming the torch version and the feature (`TorchPrivateError`), instead of an
AttributeError deep in the agent. Where torch's public surface does the job it is used instead:
`RendezvousHandler.settings` to read the handler's settings, `TCPStore(master_listen_fd=...)` to
hand torch a socket bound to one address. tests/launch/test_launch_torch_private.py checks that no
private torch name is used in launch/ outside this file.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

# one error class and one default-store accessor for the whole package: the engine's (the layer below)
from dpscale.engine.compat.torch_private import TorchPrivateError as TorchPrivateError
from dpscale.engine.compat.torch_private import default_store as default_store


def _missing(feature: str, what: str) -> TorchPrivateError:
    return TorchPrivateError(
        f"torch {torch.__version__} has no {what}, which dpscale's launcher needs for {feature}; "
        "this torch release is not supported yet"
    )


@functools.cache
def _handler_class_checked() -> None:
    """torch's DynamicRendezvousHandler as this file expects it (checked once per process)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    make = getattr(DynamicRendezvousHandler, "_create_tcp_store_server", None)
    if make is None or list(inspect.signature(make).parameters)[1:] != ["master_addr", "master_port"]:
        raise _missing(
            "binding the agent store to one address",
            "DynamicRendezvousHandler._create_tcp_store_server(master_addr, master_port)",
        )


def replace_agent_store_server(handler: Any, make: Callable[[str, int], Any]) -> None:
    """Have `handler` create the agent store (where the workers' process group meets) with
    `make(addr, port)` rather than torch's TCPStore on every interface."""
    _handler_class_checked()
    handler._create_tcp_store_server = make


def _state(handler: Any, feature: str) -> Any:
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    if state is None or not all(hasattr(state, a) for a in ("round", "participants", "wait_list")):
        raise _missing(feature, "DynamicRendezvousHandler._state_holder.state (round, participants)")
    return state


def rendezvous_round(handler: Any) -> int:
    """The round of the rendezvous `handler` last joined (the same on every host)."""
    return int(_state(handler, "the attempt number all hosts share").round)


def round_members(handler: Any) -> tuple[str, list[str], int]:
    """(this host's address, every participant's address, the round) of `handler`'s last round."""
    state = _state(handler, "naming the hosts of a round")
    this_node = getattr(handler, "_this_node", None)
    if this_node is None or not hasattr(this_node, "addr"):
        raise _missing("naming the hosts of a round", "DynamicRendezvousHandler._this_node.addr")
    return this_node.addr, [node.addr for node in state.participants], int(state.round)


def set_join_timeout(handler: Any, seconds: float) -> None:
    """From now on, `handler` waits at most `seconds` for a round to complete. The settings are
    read through torch's public `settings`; torch has no public way to change them."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    settings: Any = handler.settings
    if not (hasattr(handler, "_settings") and _is_dataclass_instance(settings)):
        raise _missing("shortening the wait for hosts that rejoin", "DynamicRendezvousHandler._settings")
    t = settings.timeout
    bounded = RendezvousTimeout(datetime.timedelta(seconds=seconds), t.last_call, t.close, t.heartbeat)
    handler._settings = dataclasses.replace(settings, timeout=bounded)


def _is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


@functools.cache
def _backend_store_calls_checked() -> None:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    call = getattr(C10dRendezvousBackend, "_call_store", None)
    if call is None or "store_op" not in inspect.signature(call).parameters:
        raise _missing("bounding rendezvous store calls", "C10dRendezvousBackend._call_store(store_op, ...)")


class StoreCallsBackend(C10dRendezvousBackend):
    """torch's c10d rendezvous backend, every store call of which goes through `on_store_call`.

    torch sends them all through its private `_call_store(op, *args)`; this subclass is the one
    place that overrides it (rendezvous._MultiHostBackend bounds each call's time).
    """

    def __init__(self, store: Any, run_id: str):
        _backend_store_calls_checked()
        super().__init__(store, run_id)

    def on_store_call(self, call: Callable[[], Any]) -> Any:
        return call()

    def _call_store(self, store_op: str, *args: Any, **kwargs: Any) -> Any:
        call = super()._call_store
        return self.on_store_call(lambda: call(store_op, *args, **kwargs))


def static_store(handler: Any) -> Any:
    """The store torch's StaticTCPRendezvous serves or joins, None before its first round."""
    if not hasattr(handler, "_store"):
        raise _missing("binding a static rendezvous store to one address", "StaticTCPRendezvous._store")
    return handler._store


def set_static_store(handler: Any, store: Any) -> None:
    static_store(handler)  # checks the attribute
    handler._store = store


def hand_back_result(value: Any) -> bool:
    """In a worker that torch's agent forked (fork_start.py), put `value` where the agent reads the
    worker's return value: the `ret_val_` queue of `torch.distributed.elastic.multiprocessing.api.
    _wrap`, a frame of the main thread. A worker that has to leave from another thread (os._exit)
    then ends as one whose function returned; without it the agent, seeing exit 0 and no value,
    would wait for it for ever. False where the main thread runs no such frame (not forked)."""
    import sys
    import threading

    from torch.distributed.elastic.multiprocessing import api

    wrap = getattr(api, "_wrap", None)
    if wrap is None:
        raise _missing("ending a forked worker from a thread", "elastic.multiprocessing.api._wrap")
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None and frame.f_code is not wrap.__code__:
        frame = frame.f_back
    if frame is None:
        return False
    queue = frame.f_locals.get("ret_val_")
    if queue is None:
        raise _missing("ending a forked worker from a thread", "a ret_val_ queue in _wrap")
    queue.put(value)
    return True
