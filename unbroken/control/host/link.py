"""The agent's line to the coordinator: its store, each call bounded in time.

Owns ``CoordinatorLink``: the store connection (and its tunnel) to the coordinator at ``address``, the calls the
agent's parts make over it (``call``: None, and no more calls, once the coordinator is gone or unreachable, until
``attach`` points it at a coordinator again, the same one or an etcd standby), and the few questions and reports
they share: the newest members, a refused id, a record to publish, a request to stop the job. The agent knows the
coordinator only through the store (``control.store.keys``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from unbroken.control.store import keys
from unbroken.control.store.connect import CallGuard, open_store, publish_record, request_stop, ring
from unbroken.control.store.gateway import Tunnel

# A store call of the agent's that takes longer than this is cut (the coordinator's host unreachable): the agent
# then looks for a coordinator again, the same one or an etcd standby.
CALL_LIMIT_S = 10.0


class CoordinatorLink:
    """The store of the coordinator at ``address`` (none until ``attach``)."""

    def __init__(self) -> None:
        self.address = ""  # what the host's processes are told (``COORDINATOR_ENV``)
        self.store: Any = None
        self.tunnel: Tunnel | None = None
        self.guard = CallGuard(CALL_LIMIT_S)

    def attach(self, address: str, token: str, reached: tuple[Any, Tunnel] | None = None) -> None:
        """Talk to the coordinator at ``address`` (again, after it restarted), over ``reached`` (a store connection
        and its tunnel) if given."""
        self.address = address
        self.store, self.tunnel = reached if reached is not None else open_store(address, token=token)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(store, *args)``; None (and no more calls until ``attach``) if the coordinator is gone."""
        if self.store is None:
            return None
        store = self.store
        try:
            return self.guard.call(self.tunnel, lambda: fn(store, *args))
        except RuntimeError:
            self.store = None  # the coordinator is gone or restarting; the owner reconnects
            return None

    def tell(self, key: str, value: str) -> None:
        """Set ``key`` and ring the coordinator's bell."""
        self.call(lambda s: (s.set(key, value), ring(s)))

    def record(self, record: dict[str, Any]) -> None:
        """Publish ``record`` to the run's records (the coordinator writes it)."""
        self.call(lambda s: publish_record(s, record))

    def stop_job(self, reason: str) -> None:
        """Ask every process of the job to stop, unless someone already did: the first reason is the one the
        coordinator records (a worker's own line, not "every worker exited" that follows from it)."""
        self.call(request_stop, reason)

    def newest_members(self) -> list[int] | None:
        """The members of the newest epoch; None before the first (or without a coordinator)."""

        def read(s: Any) -> list[int]:
            return json.loads(s.get(keys.epoch(int(s.get(keys.EPOCH)))))["members"]

        return self.call(read)

    def refused(self, wid: int) -> bool:
        """The coordinator refused ``wid`` (``keys.refused``: another fingerprint, or barred as fail-slow)."""
        try:
            return self.store is not None and self.store.check([keys.refused(wid)])
        except RuntimeError:
            return False  # the coordinator is gone: restart as usual
