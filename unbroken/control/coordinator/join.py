"""The coordinator's admission: registrations answered with a worker id, refusals, the first epoch's members, and
when joiners are taken in.

Owns the admitted workers (each one's registration request), the ids handed out, the exact-mode fingerprint every
member shares (``core.numerics``: fixed when the first epoch forms, or by the first member back after a restart; a
joiner that differs is refused, as is one barred as fail-slow), and the joiners' last call: joiners are taken in
once registrations have been quiet ``JOIN_QUIET_S``, or the first of them has waited ``JOIN_WAIT_MAX_S`` (a steady
trickle cannot hold them back), so 64 workers registering within moments of each other join in one epoch change,
not 64; a promoted warm spare is taken in at once (it replaces one death, and a replacement in under a second is
what spares are for); a replica of several ranks only once all of its ranks have registered. The start's deadline
(``comm.join_timeout_s``) is the loop's (``loop.Coordinator``), on the count admitted here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from unbroken.control.coordinator.restore import Restore
from unbroken.control.coordinator.watch import Watch
from unbroken.control.store import keys
from unbroken.control.store.connect import get_int, read_json
from unbroken.core.layout import ReplicaLayout
from unbroken.core.numerics import group_fingerprint, refusal
from unbroken.core.records import RecordKind

log = logging.getLogger(__name__)

JOIN_QUIET_S = 0.25
JOIN_WAIT_MAX_S = 2.0


class Admission:
    """Registrations and joins for one coordinator. ``emit``: writes a record of a kind with fields; ``announce``:
    rings the workers' doorbell (after a refusal); ``watch``: told of each admission (its heartbeats are watched
    from then); ``restore``: a restarted coordinator's wait, whose members come back here; ``barred``: the line of
    a worker that may not come back (``FailSlowActions.barred``)."""

    def __init__(
        self,
        store: Any,
        layout: ReplicaLayout,
        exact: bool,
        emit: Callable[..., None],
        announce: Callable[[], None],
        watch: Watch,
        restore: Restore,
        barred: dict[int, str],
    ) -> None:
        self.store = store
        self.layout = layout
        self.exact = exact
        self.emit = emit
        self.announce = announce
        self.watch = watch
        self.restore = restore
        self.barred = barred
        self.next_registration = 1
        self.next_worker_id = restore.next_worker_id
        self.admitted: dict[int, dict[str, Any]] = dict(restore.admitted)
        # Exact mode: the fingerprint every member shares, fixed when the first epoch forms (after a restart: the
        # first member that comes back); a joiner that differs is refused.
        self.fingerprint: dict[str, str] | None = None
        self.refused: set[int] = set()
        self.joining: set[int] = set()  # admitted workers not taken in yet (a replica not complete, the last call)
        self.joining_since = self.last_registration = 0.0

    def admit_new(self, epoch: int, members: tuple[int, ...]) -> list[int]:
        """Answer the registrations since the last look (``epoch``, ``members``: the current ones); the workers
        to take in (not those refused, nor members that kept the state through a restart of this coordinator)."""
        joined = []
        seq = get_int(self.store, keys.REGISTER_SEQ)
        while self.next_registration <= seq:
            n = self.next_registration
            if not self.store.check([keys.register(n)]):
                break  # the worker incremented the counter but has not written its request yet
            request = read_json(self.store, keys.register(n))
            wid, returning = self._worker_id(request, epoch, members)
            self.admitted[wid] = request
            self.watch.admitted(wid)
            self.store.delete_key(keys.dead(wid))
            self.store.delete_key(keys.refused(wid))
            line = self._admitted(wid, request, epoch, returning)
            self.store.set(keys.register_late(n), "1" if epoch > 0 and not returning else "0")
            self.store.set(keys.register_id(n), str(wid))
            if returning:
                self.restore.returned.add(wid)  # a member that kept the state through the coordinator's restart
            elif line is None:
                joined.append(wid)
            self.next_registration += 1
        return joined

    def _worker_id(self, request: dict[str, Any], epoch: int, members: tuple[int, ...]) -> tuple[int, bool]:
        """The id ``request`` is answered with, and whether it is a member returning to a restarted coordinator."""
        wid = request.get("worker_id", -1)
        # Before the first epoch an admitted id may register again: a restart of a process that died (its death
        # was reported) keeps its id; anything else is a duplicate and gets a fresh one.
        replaced = wid in self.admitted and epoch == 0 and self.store.check([keys.dead(wid)])
        returning = bool(request.get("returning")) and self.restore.awaits(wid)
        taken = wid in members or (wid in self.admitted and not replaced and epoch == 0)
        if wid is None or wid < 0 or (taken and not returning):
            wid = max([self.next_worker_id, *[w + 1 for w in self.admitted]])
        # A worker that died may come back under its old id (the launcher restarts it so).
        self.next_worker_id = max(self.next_worker_id, wid + 1)
        return wid, returning

    def _admitted(self, wid: int, request: dict[str, Any], epoch: int, returning: bool) -> str | None:
        """Record ``wid``'s admission; the line refusing it (told before its id is answered, so it learns at
        registration), or None."""
        fingerprint = request.get("fingerprint") or {}
        self.emit(
            RecordKind.ADMITTED,
            worker=wid,
            host=str(request.get("host", "")),
            fingerprint=fingerprint,
            start_s=request.get("start_s"),
            start_cpu_s=request.get("start_cpu_s"),
            forked=bool(request.get("forked")),
        )
        if self.exact and self.fingerprint is None and (returning or epoch > 0):
            self.fingerprint = fingerprint  # a restarted coordinator: the state's holders define the group
        line = refusal(wid, fingerprint, self.fingerprint) if self.exact and self.fingerprint else None
        line = self.barred.get(wid, line)
        if line is not None and not returning:
            self.refuse(wid, line)
        return line

    def refuse(self, wid: int, line: str) -> None:
        """Keep ``wid`` out of the membership (exact mode, another fingerprint; barred): it reads why and leaves."""
        self.refused.add(wid)
        self.store.set(keys.refused(wid), line)
        self.emit(RecordKind.REFUSED, worker=wid, reason=line)
        log.warning("%s", line)
        self.announce()

    def start_members(self) -> tuple[int, ...]:
        """The first epoch's members: every admitted worker; under exact mode only those whose fingerprint is
        the one most of them share (the others are refused)."""
        admitted = [w for w in self.admitted if w not in self.refused]
        if not self.exact or not admitted:
            return tuple(admitted)
        fingerprints = {w: self.admitted[w].get("fingerprint") or {} for w in admitted}
        self.fingerprint = dict(group_fingerprint(fingerprints))
        members = []
        for wid in admitted:
            line = refusal(wid, fingerprints[wid], self.fingerprint)
            if line is None:
                members.append(wid)
            else:
                self.refuse(wid, line)
        return tuple(members)

    def promoted_spare(self, wid: int) -> bool:
        """Whether ``wid`` registered as a warm spare promoted to a dead worker's place: it is taken in at once,
        not at the joiners' last call (it replaces a death its agent has just reported, and is already built)."""
        return self.admitted.get(wid, {}).get("spare") is not None

    def ready(self, joined: list[int], members: tuple[int, ...], now: float) -> list[int]:
        """The joiners to take in now (``joined``: those admitted at this look; ``members``: the current ones):
        at the last call, whole replicas only; a promoted spare at once."""
        if joined:
            self.joining_since = self.joining_since if self.joining else now
            self.last_registration = now
        self.joining |= set(joined)
        ready = [w for w in self.layout.whole(self.joining) if w not in members]
        last_call = now - self.last_registration >= JOIN_QUIET_S
        if not (last_call or now - self.joining_since >= JOIN_WAIT_MAX_S):
            ready = [w for w in ready if self.promoted_spare(w)]
        elif ready:
            self.joining_since = now  # the ranks of a replica still incomplete wait anew
        self.joining -= set(ready)
        return ready

    def next_id(self) -> int:
        """The lowest id never handed out (saved with the hard state)."""
        return max([self.next_worker_id, *(w + 1 for w in self.admitted)])
