"""A worker's connections to its coordinator's store: the training thread's, the heartbeat sender's, the news
watcher's, and a spare opened ahead for the next blocking user (a group's rendezvous).

Each is its own (a TCPStore client is one socket, one call at a time), and each sits on an authenticated tunnel
whose ``cut`` ends a call blocked on it whatever state its socket is in. Owns which coordinator address the worker
is connected to; which one that should be is the reconnection's to decide (``control.member.reconnect``).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import threading

from torch.distributed import TCPStore

from unbroken.control.store.connect import STORE_TIMEOUT_S, connect_store, end_get, open_store, reach
from unbroken.control.store.gateway import Tunnel


class Connections:
    """The connections of one worker to the first of ``addresses`` that answers (the coordinator, then its
    standbys); one the network does not reach is tried again for up to ``patience_s`` (a worker restarted while
    its host's link flaps), one where nothing listens is not. The watchers' connections are opened at once
    (``open_watchers``), their calls time out after ``op_timeout_s``."""

    def __init__(self, addresses: list[str], token: str, op_timeout_s: float, patience_s: float) -> None:
        self.token = token
        self._op_timeout = datetime.timedelta(seconds=op_timeout_s)
        self._lock = threading.Lock()  # new_connection is called from the training and former threads
        self._spare_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store-spare")
        self._spare: concurrent.futures.Future[TCPStore] | None = None
        self.store, self._store_tunnel, self.address = reach(addresses, token, patience_s)
        self.open_watchers()

    def open_watchers(self) -> None:
        """The watchers' connections, opened before registering: the coordinator counts a worker's silence from
        its admission, and opening a connection alone can take seconds (see ``new_connection``; 64 workers joining
        at once on 2 cores: 42 of them were declared dead before their first heartbeat). Connected with the long
        timeout, then their waits time out within the heartbeat bound. A call already sent to a host the network
        no longer reaches is not bounded by it (it waits for TCP to give up): the stall watch covers that case."""
        self.sender_store, self._sender_tunnel = open_store(self.address, token=self.token)
        self.sender_store.set_timeout(self._op_timeout)
        self.news_store, self._news_tunnel = open_store(self.address, token=self.token)
        self.news_store.set_timeout(self._op_timeout)
        with self._lock:
            self._spare = self._spare_pool.submit(connect_store, self.address, STORE_TIMEOUT_S, self.token)

    def adopt(self, address: str, store: TCPStore, tunnel: Tunnel) -> None:
        """Use ``store`` (through ``tunnel``, at ``address``: another coordinator) as the training thread's."""
        self.store, self._store_tunnel, self.address = store, tunnel, address

    def cut(self) -> None:
        """End every call on the current connections now: a coordinator whose host was cut off answers nothing and
        resets nothing, and a call on it would wait for TCP to give up (minutes)."""
        for tunnel in (self._news_tunnel, self._sender_tunnel, self._store_tunnel):
            tunnel.cut()

    def end_news_wait(self) -> None:
        """End the news watcher's store wait, a get of the next ring's key (``news.next_news``), as if its key had
        come with nothing in it, and close its connection (``end_get``): the get returns, where a connection cut
        under it fails it and c10d writes a C++ stack on stderr (at the end of a user's script). Not by ringing the
        workers' doorbell: a ring is two store calls, and a worker that ends between them (excluded as its link
        came back, killed) leaves a count with no key, on which every other worker's watcher would wait until
        ``NEWS_WAIT_S``."""
        end_get(self._news_tunnel)

    def new_connection(self) -> TCPStore:
        """Another authenticated connection to the store, for a blocking user such as a group's rendezvous:
        a wait abandoned on it cannot hold up this worker's own store calls, which share one socket.

        The connection was opened ahead on a background thread (and the next one is started now): torch
        formats a new socket's addresses with getnameinfo, a reverse DNS lookup that stalls for the
        resolver's timeout (5 s) where DNS is slow or unreachable, and recovery must not wait for that."""
        with self._lock:
            spare = self._spare
            self._spare = self._spare_pool.submit(connect_store, self.address, STORE_TIMEOUT_S, self.token)
        try:
            if spare is not None:
                return spare.result(timeout=STORE_TIMEOUT_S)
        except (RuntimeError, ConnectionError, concurrent.futures.TimeoutError):
            pass  # the spare failed: one more try, here
        return connect_store(self.address, token=self.token)

    def close(self) -> None:
        """No spare connection is opened any more (one being opened is abandoned)."""
        self._spare_pool.shutdown(wait=False, cancel_futures=True)
