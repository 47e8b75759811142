"""A worker's watch of the coordinator's news: a cached view of the membership epochs and of the stop flag, so that
the training thread's checks never touch the network.

From this host's news relay where the agent runs one (``control.member.news``: one watcher of the coordinator per
host), else, or once the relay is gone, from the store: a get of the next ``news/<n>`` (it waits for the key,
``news.next_news``), rung by the coordinator right after it publishes an epoch or a stop, so either is seen as soon
as it is published; the wait also ends every ``NEWS_WAIT_S`` for a look anyway (rarely: c10d logs a line for every
store wait that times out, and a dead coordinator ends the wait at once, a hung one is found by the heartbeat
sender). The epoch and the stop are read after the doorbell's count (or the ring) they follow, and the coordinator
writes them before ringing: nothing published is missed.

Owns what the worker knows of the membership: the newest epoch, the epochs that removed members (a collective is
abandoned only when one of its members was removed), whether this worker was excluded, and the stop's reason.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from torch.distributed import TCPStore

from unbroken.control.member.news import (
    NEWS_WAIT_S,
    RELAY_GRACE_S,
    FrameKind,
    RelayedNews,
    RelayGone,
    RelayQuiet,
    look,
    next_news,
)
from unbroken.control.store import keys
from unbroken.control.store.connect import read_json

log = logging.getLogger(__name__)


class NewsWatch:
    """The news as worker ``worker_id`` has it. ``run`` is the watcher thread's body (one per connection);
    ``stopping``, once set, ends it. ``epoch`` and ``members``: the newest epoch when the worker registered and
    its members (none before the first epoch). ``relay_path``: the socket of this host's news relay (None: watch
    the store)."""

    def __init__(
        self,
        worker_id: int,
        epoch: int,
        members: frozenset[int],
        relay_path: str | None,
        stopping: threading.Event,
    ) -> None:
        self.worker_id = worker_id
        self.latest_epoch = epoch
        self.seen_epoch, self.seen_members = epoch, members
        self.stopped: str | None = None
        self.excluded = False  # an epoch removed this worker after it had been a member
        # Epochs that removed workers, as (epoch, removed ids): a collective is abandoned only when one of its
        # members was removed (or, for a re-formation after a stalled collective, every member counts as removed
        # from the old group). A join alone never interrupts one (every member is alive, so it completes), which
        # keeps all members' collective sequences matched.
        self.removals: list[tuple[int, frozenset[int]]] = []
        # Called with (epoch, members) of each newest epoch read (the step protocol forms the epoch's group ahead
        # of need): must be quick and must not raise.
        self.on_epoch: Callable[[int, tuple[int, ...]], None] | None = None
        self.relay: RelayedNews | None = None  # the connection to the host's relay, while the watch has one
        self.wait_s = NEWS_WAIT_S
        self._relay_path = relay_path
        self._stopping = stopping

    def note_stop(self, reason: str) -> None:
        """The run stops for ``reason``, unless a reason was noted already (the first one is kept)."""
        self.stopped = self.stopped or reason

    def note_epoch(self, epoch: int) -> None:
        """An epoch read outside the watch (the first-epoch wait): the newest known is at least ``epoch``."""
        self.latest_epoch = max(self.latest_epoch, epoch)

    def removed_since(self, epoch: int, members: tuple[int, ...]) -> bool:
        """True if an epoch newer than ``epoch`` removed one of ``members`` (cheap: the watcher's cache)."""
        return any(e > epoch and not removed.isdisjoint(members) for e, removed in self.removals)

    def drop_relay(self) -> None:
        """Close the relay's connection, if the watch has one (its ``next()`` in the watcher raises RelayGone)."""
        if (relay := self.relay) is not None:
            relay.close()

    def run(self, store: TCPStore, incarnation: str) -> None:
        """Watch the news of coordinator ``incarnation`` until ``stopping``: from the relay while it serves, then
        from ``store`` (this watch's own connection). A failed store call raises RuntimeError. Its owner ends the
        watch by setting ``stopping`` and then ending the get the watch sleeps in (``connect.end_get``): the watch
        returns from it with no other store call."""
        if self._relay_path is not None and self._watch_relay(store, self._relay_path, incarnation):
            return
        news = look(store)
        while not self._stopping.is_set():
            if news.newest > self.seen_epoch:
                self.advance(store, news.newest, news.record)
            if self.stopped is None and news.record is None and store.check([keys.STOP]):
                self.stopped = store.get(keys.STOP).decode()
            news = next_news(store, news, self.wait_s, self._stopping)  # the watch's last call once it closes

    def advance(self, store: TCPStore, newest: int, known: dict[str, Any] | None = None) -> None:
        """Read the epochs after the last one seen up to ``newest`` (``known``: the newest one's record, from
        its ring): note the removals, then the epoch; then tell ``on_epoch`` of the newest one read."""
        read: tuple[int, tuple[int, ...]] | None = None
        for epoch in range(self.seen_epoch + 1, newest + 1):
            # The newest is there (its record is written before the epoch number): one call less per member
            # and epoch change. An older one may have been published by a coordinator that died before this
            # one (a restart skips it).
            if epoch < newest and not store.check([keys.epoch(epoch)]):
                continue
            record = known if epoch == newest and known is not None else read_json(store, keys.epoch(epoch))
            members = frozenset(record["members"])
            removed = self.seen_members if record.get("reform") else self.seen_members - members
            if removed:
                self.removals.append((epoch, removed))
            if self.worker_id in self.seen_members and self.worker_id not in members:
                self.excluded = True
            self.seen_epoch, self.seen_members = epoch, members
            read = (epoch, tuple(sorted(members)))
        self.seen_epoch = max(self.seen_epoch, newest)
        self.latest_epoch = max(self.latest_epoch, newest)  # after the removals: readers check both
        if read is not None and read[0] == self.latest_epoch and self.on_epoch is not None:
            self.on_epoch(*read)

    def _watch_relay(self, store: TCPStore, path: str, incarnation: str) -> bool:
        """The news from this host's relay until it is gone: True if the watch is over (the client closes),
        False to watch the store instead. Epochs the relay skipped are read from ``store`` (``advance``)."""
        try:
            relay = RelayedNews(path, incarnation, self.wait_s)
        except OSError as e:
            log.info("no news relay at %s (%s); watching the coordinator", path, e)
            return False
        self.relay = relay
        log.info("epoch news from this host's relay at %s", path)
        grace_s = min(RELAY_GRACE_S, self.wait_s)
        behind = False  # the last quiet look found news in the store that the relay had not passed on
        try:
            while not self._stopping.is_set():
                try:
                    frame = relay.next()
                except RelayQuiet:
                    ahead = self._store_ahead_of_relay(store)
                    if ahead and behind:  # still not passed on after the grace: the relay missed it
                        self._relay_missed_news(store)
                        return False
                    behind = ahead
                    relay.set_quiet(grace_s if behind else self.wait_s)
                    continue
                if behind:
                    behind = False
                    relay.set_quiet(self.wait_s)
                if frame.kind is FrameKind.EPOCH and frame.epoch > self.seen_epoch:
                    self.advance(store, frame.epoch, frame.record)
                elif frame.kind is FrameKind.STOP and self.stopped is None:
                    self.stopped = frame.reason
        except RelayGone as e:
            if not self._stopping.is_set():
                log.log(logging.INFO if e.closed else logging.WARNING, "news relay: %s; watching the coordinator", e)
        finally:
            self.relay = None
            relay.close()
        return self._stopping.is_set()

    def _store_ahead_of_relay(self, store: TCPStore) -> bool:
        """After a quiet period without news from the relay, the look a watcher of the store makes as often:
        whether the store holds an epoch or a stop this worker has not had."""
        return look(store).newest > self.seen_epoch or (self.stopped is None and store.check([keys.STOP]))

    def _relay_missed_news(self, store: TCPStore) -> None:
        """Take from the store the news the relay did not pass on (``_store_ahead_of_relay`` twice, a grace apart)."""
        log.warning("news relay: it did not pass on the store's news; watching the coordinator")
        news = look(store)
        if news.newest > self.seen_epoch:
            self.advance(store, news.newest)
        if self.stopped is None and store.check([keys.STOP]):
            self.stopped = store.get(keys.STOP).decode()
