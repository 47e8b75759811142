"""A worker's delivery of metrics records to the coordinator: a queue the training thread fills without waiting
on the network, emptied into the store by the heartbeat sender between its beats (``control.member.heartbeat``).

Owns the order of delivery (records reach the store in the order they were queued; a flush marks a point in that
order), the record the sender had in hand when its connection failed (delivered first on the next connection), and
the recent records kept to send again to a coordinator that replaced a dead one (it drops duplicates).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed import TCPStore

from unbroken.control.store.connect import STORE_TIMEOUT_S, publish_record

RECENT_RECORDS = 256  # records kept to send again to a coordinator that replaced a dead one
FLUSH_POLL_S = 0.05  # how often a flush looks whether the client was lost meanwhile


class MetricsOutbox:
    """Records on their way to the coordinator's metrics.jsonl: ``put`` from any thread, ``deliver`` from the
    sender's, ``close`` once (the sender ends after what was queued before it)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[dict[str, Any] | threading.Event | None] = queue.SimpleQueue()
        self._in_hand: dict[str, Any] | None = None  # the record the sender was publishing when it failed
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_RECORDS)

    def put(self, record: dict[str, Any]) -> None:
        """Queue ``record``; the sender delivers it."""
        self._queue.put(record)

    def flush(self, lost: Callable[[], bool], timeout_s: float = STORE_TIMEOUT_S) -> bool:
        """Wait until every record queued so far is in the store; False if that did not happen in time or
        ``lost()`` became true meanwhile (no coordinator came back)."""
        delivered = threading.Event()
        self._queue.put(delivered)
        deadline = time.monotonic() + timeout_s
        while not delivered.wait(FLUSH_POLL_S):
            if lost() or time.monotonic() > deadline:
                return False
        return True

    def close(self) -> None:
        """The sender ends once it has delivered everything queued before this."""
        self._queue.put(None)

    def resend_recent(self) -> None:
        """Queue again the records delivered lately: the coordinator that replaced a dead one may not have them."""
        for record in list(self._recent):
            self._queue.put(record)

    def deliver(self, store: TCPStore, wait_s: float) -> bool:
        """Deliver the next record into ``store``, waiting up to ``wait_s`` for one (a record in hand from a failed
        connection goes first); False once ``close`` was reached. A failed store call raises RuntimeError and
        keeps the record in hand."""
        if self._in_hand is None:
            try:
                item = self._queue.get(timeout=max(0.0, wait_s))
            except queue.Empty:
                return True
            if item is None:
                return False
            if isinstance(item, threading.Event):
                item.set()  # a flush: everything queued before it is in the store
                return True
            self._in_hand = item
        publish_record(store, self._in_hand)
        self._recent.append(self._in_hand)
        self._in_hand = None
        return True
