"""The coordinator's epochs: the membership it publishes, the hard state saved ahead of each, and the workers'
doorbell it rings.

Owns the current epoch and its members, the epoch floor (a new launch of a run continues its epoch numbers: the
journal refuses older ones), the save of the hard state (``store.durable``) before an epoch is published (an epoch
number is then never handed out twice, whatever happens to this process; a deposed coordinator stops here), and the
ring of ``keys.NEWS`` that carries each epoch's record to every member's watcher.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from unbroken.control.store import keys
from unbroken.control.store.connect import get_int
from unbroken.control.store.durable import StaleWriteError, State, StateStore, StateUnavailableError
from unbroken.core.records import RecordKind

log = logging.getLogger(__name__)

SAVE_RETRY_S = 0.1  # between saves of an epoch while the state store is out of reach


class Deposed(Exception):
    """This coordinator no longer leads: another one took over (internal)."""


def save_hard_state(state_store: StateStore, state: State, must: bool, stopping: threading.Event) -> bool:
    """Write ``state`` ahead of publishing its epoch (an epoch number is then never handed out twice, whatever
    happens to this process); True once written.

    While the store cannot be reached (etcd electing its leader, or this host cut off from its majority), a save
    that an epoch waits for (``must``) is tried again for as long as this coordinator's lease lasts, and a
    coordinator whose lease ran out meanwhile stops acting (``Deposed``, ``stopping`` set): it publishes nothing it
    could not save. Any other save is left to the next pass (False)."""
    while True:
        try:
            state_store.save(state)
            return True
        except StaleWriteError as e:
            log.error("another coordinator leads now (%s); stepping down", e)
            stopping.set()
            raise Deposed from e
        except StateUnavailableError as e:
            if not state_store.is_leader():
                log.error("the state store is out of reach and this coordinator's lease ran out; stepping down")
                stopping.set()
                raise Deposed from e
            if not must:
                log.warning("the state store is out of reach (%s); saving on a later pass", e)
                return False
            log.warning("the state store is out of reach (%s); epoch %d waits until it is saved", e, state.epoch)
            time.sleep(SAVE_RETRY_S)


class Epochs:
    """Publishes epochs into ``store``. ``save(epoch, members)``: saves the hard state ahead of one (``Deposed``
    if this coordinator no longer leads); ``emit``: writes a record of a kind with fields."""

    def __init__(
        self,
        store: Any,
        save: Callable[[int, tuple[int, ...]], None],
        emit: Callable[..., None],
        epoch: int = 0,
        epoch_floor: int = 0,
    ) -> None:
        self.store = store
        self.save = save
        self.emit = emit
        self.epoch = epoch
        self.epoch_floor = epoch_floor
        self.members: tuple[int, ...] = ()
        self.started = time.monotonic()
        self.news_rung = get_int(store, keys.doorbell_seq(keys.NEWS))  # the workers' doorbell, last rung here

    def announce(self, epoch_record: str = "") -> None:
        """Ring the workers' doorbell, after publishing an epoch, a refusal or a stop. A ring is two calls (the
        count, then its key); one whose key never came (its ringer gone between them) would hold every watcher
        waiting on that key, so each count since this coordinator's last ring gets its key now. The ring of an
        epoch holds its record (as ``keys.epoch`` does), every other ring nothing: a watcher's get of the next
        ring waits for it and returns the epoch's record (``newsrelay.next_news``), one call per member at every
        epoch change."""
        n = self.store.add(keys.doorbell_seq(keys.NEWS), 1)
        for k in range(self.news_rung + 1, n + 1):
            self.store.set(keys.doorbell(keys.NEWS, k), epoch_record if k == n else "")
        self.news_rung = n

    def publish(self, members: tuple[int, ...], reason: str, reform: bool = False, workload: str = "") -> None:
        """Save, then publish the next epoch of ``members`` (``reform``: the same members form a fresh group;
        ``workload``: the workload it carries when the coordinator switched it) and ring it."""
        epoch = max(self.epoch, self.epoch_floor) + 1
        self.save(epoch, members)
        self.epoch = epoch
        self.members = tuple(sorted(members))
        record: dict[str, Any] = {"epoch": epoch, "members": list(self.members), "reason": reason, "reform": reform}
        if workload:
            record["workload"] = workload
        text = json.dumps({**record, "time": time.time()})
        self.store.set(keys.epoch(epoch), text)
        self.store.set(keys.EPOCH, str(epoch))
        self.announce(text)
        self.emit(RecordKind.MEMBERSHIP, **record, elapsed_s=time.monotonic() - self.started)
        log.info("epoch %d: members %s (%s)", epoch, list(self.members), reason)
