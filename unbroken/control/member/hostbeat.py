"""A host's heartbeats: its workers beat into memory they share with their agent, and the agent passes the beats
on to the coordinator in one store call per interval for all of them (``comm.heartbeats = "host"``).

With per-worker heartbeats (the default) every worker sends one ``add`` through its tunnel and the coordinator's
gateway every interval: 4,096 calls a second at 1,024 members, most of the coordinator's load at rest
(docs/benchmarks.md, "control-scale"). With host heartbeats a worker started by an agent increments its own
counter in a board its agent made (``BeatBoard``: a file both map, so a beat is a memory write and never waits on
the network), and the agent (``HostBeats``) looks at the board every interval and writes, in one ``multi_set``,
a new value of ``keys.heartbeat`` for each worker whose counter moved since its last look.

The coordinator is unchanged by it: a member's heartbeat key moves while that member beats, whoever writes it.
A hung worker (SIGSTOP) stops moving its counter, so its key stops; a lost host (its processes killed, its link
cut) stops every key; the stop's drain and the saver's wait watch the same keys. The agent only saves calls, it
is never needed: it notes on the board when it last passed the beats on, and a worker that finds that note older
than ``BEHIND_INTERVALS`` heartbeat intervals (its agent not started yet, stopped, starved of the CPU, killed, or
its calls failing) sends its own ``add`` with each beat until the agent catches up. A worker also sends its own
until the agent has passed one of its beats on: the coordinator counts a member's silence from its admission, and
an agent whose call is under way when the worker starts beating would otherwise be the worker's only messenger
until it counts as behind (at 1,024 members, 10 members admitted last were declared dead that way:
docs/benchmarks.md, "Heartbeats by host at 1,024 again"). A worker's takeover check (``reconnect.Reconnection.
watch_for_successor``: is another coordinator leading?) reads from the board since when its agent's calls have not
gone through, as well as timing its own calls.

The value written for a key is the agent's pass stamp (microseconds since the epoch when its look began, and
larger than every stamp it wrote before): it differs from the last value seen whoever wrote that, so a worker
that moved to another host, or whose coordinator restarted, is not taken for silent. Nothing is written for a
worker whose counter did not move.

Owns the board's format: little-endian 8-byte words in a file in a directory only its user can enter. Word 0 is
``MAGIC``; words 1 and 2 are the agent's, each the bits of a double holding a ``time.monotonic()``
(``CLOCK_MONOTONIC``, the same clock in every process of a host): word 1 since when it has been failing to pass
the beats on (when the first call or connection since its last call that succeeded began; 0.0 while its calls
succeed), word 2 when the last look whose beats went through began (0.0: never; every beat counted before then has
been passed on); then two words a slot: the
worker id the slot beats for (-1 before its worker registered) and the count of its beats. Each word is written
whole by one process (the id and the count by the slot's worker, words 1 and 2 by the agent), so a reader sees an
old value or a new one.
"""

from __future__ import annotations

import datetime
import logging
import mmap
import os
import shutil
import struct
import tempfile
import threading
import time
from typing import Any, Protocol

from unbroken.control.store import keys
from unbroken.control.store.connect import CallGuard, open_store
from unbroken.control.store.gateway import Tunnel, TunnelError

log = logging.getLogger(__name__)

HOST_BEAT_ENV = "UNBROKEN_HOST_BEAT"  # "<slot>:<board path>", set by the agent for each process it starts
MAGIC = 0x756E62726F6B6862  # "unbrokhb"
HEADER_WORDS = 3
# A worker whose agent has not passed the beats on for this many heartbeat intervals sends its own (the agent looks
# LOOKS_PER_INTERVAL times an interval, so a live one is never that late but starved or stopped).
BEHIND_INTERVALS = 2
SLOT_WORDS = 2
NO_WORKER = -1
# The agent looks at the board twice per heartbeat interval: a beat waits at most half an interval to be passed on,
# so the coordinator sees it at most that much later than the worker's own call would have brought it, and a
# starved worker's margin before the heartbeat timeout shrinks by that much, not by a whole interval.
LOOKS_PER_INTERVAL = 2
DEFAULT_SLOTS = 1024  # an agent's processes alive at once, at most (16 KiB)
_WORD = 8
_TIME = struct.Struct("<d")
_FAILING_SINCE, _PASSED_AT = _WORD, 2 * _WORD  # the byte offsets of words 1 and 2


class BeatBoard:
    """The shared words: ``create`` (the agent) or ``attach`` (a worker, from ``HOST_BEAT_ENV``)."""

    def __init__(self, path: str, mapped: mmap.mmap, slots: int) -> None:
        self.path = path
        self.slots = slots
        self._map = mapped
        self._words = memoryview(mapped).cast("q")

    @classmethod
    def create(cls, slots: int = DEFAULT_SLOTS) -> BeatBoard:
        if slots < 1:
            raise ValueError(f"a beat board needs at least one slot, not {slots}")
        directory = tempfile.mkdtemp(prefix="unbroken-beats-")  # mode 0700: only this user's processes map it
        path = os.path.join(directory, "board")
        size = (HEADER_WORDS + SLOT_WORDS * slots) * _WORD
        with open(path, "w+b") as f:
            f.truncate(size)
            mapped = mmap.mmap(f.fileno(), size)
        board = cls(path, mapped, slots)
        board._words[0] = MAGIC
        for slot in range(slots):
            board.reset(slot)
        return board

    @classmethod
    def attach(cls, path: str) -> BeatBoard:
        """The board at ``path``; ValueError if the file is not one."""
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size < (HEADER_WORDS + SLOT_WORDS) * _WORD or (size // _WORD - HEADER_WORDS) % SLOT_WORDS:
                raise ValueError(f"{path} is not a beat board ({size} bytes)")
            mapped = mmap.mmap(f.fileno(), size)
        board = cls(path, mapped, (size // _WORD - HEADER_WORDS) // SLOT_WORDS)
        if board._words[0] != MAGIC:
            raise ValueError(f"{path} is not a beat board (its first word is {board._words[0]:#x})")
        return board

    # -- a slot ---------------------------------------------------------------------------------------
    def _word(self, slot: int, field: int) -> int:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not on a board of {self.slots}")
        return HEADER_WORDS + SLOT_WORDS * slot + field

    def reset(self, slot: int) -> None:
        """Before a new process gets ``slot``: nobody's, no beats."""
        self._words[self._word(slot, 0)] = NO_WORKER
        self._words[self._word(slot, 1)] = 0

    def claim(self, slot: int, worker_id: int) -> None:
        """The slot's process beats for ``worker_id`` from now on (its id, once the coordinator admitted it)."""
        self._words[self._word(slot, 0)] = worker_id

    def beat(self, slot: int) -> None:
        index = self._word(slot, 1)
        self._words[index] = self._words[index] + 1

    def read(self, slot: int) -> tuple[int, int]:
        """(the worker id, its count)."""
        return self._words[self._word(slot, 0)], self._words[self._word(slot, 1)]

    # -- the agent's calls ----------------------------------------------------------------------------
    def call_began(self, at: float) -> None:
        """A call (or a connection) is starting at ``at``: from then on the beats are undelivered, unless they
        already were since earlier."""
        if self.call_since() is None:
            _TIME.pack_into(self._map, _FAILING_SINCE, at)

    def call_ended(self) -> None:
        """A call went through: the beats are delivered."""
        _TIME.pack_into(self._map, _FAILING_SINCE, 0.0)

    def call_since(self) -> float | None:
        """Since when (``time.monotonic()``) the agent's calls have not gone through, None while they do."""
        at = _TIME.unpack_from(self._map, _FAILING_SINCE)[0]
        return at or None

    def passed(self, at: float) -> None:
        """The agent's look that began at ``at`` is over and its beats (if any moved) went through: every beat
        counted before ``at`` has been passed on."""
        _TIME.pack_into(self._map, _PASSED_AT, at)

    def passed_at(self) -> float | None:
        at = _TIME.unpack_from(self._map, _PASSED_AT)[0]
        return at or None

    def close(self) -> None:
        self._words.release()
        self._map.close()


class WorkerBeat:
    """A worker's slot on its host's board: ``from_env`` where its agent gave it one."""

    def __init__(self, board: BeatBoard, slot: int) -> None:
        self.board, self.slot = board, slot

    @classmethod
    def from_env(cls, value: str | None = None) -> WorkerBeat | None:
        """The slot ``HOST_BEAT_ENV`` names (None: not set, the worker beats to the coordinator itself). A value
        that names no board is a launch defect: ValueError."""
        value = os.environ.get(HOST_BEAT_ENV) if value is None else value
        if not value:
            return None
        slot, sep, path = value.partition(":")
        if not sep or not slot.isdigit():
            raise ValueError(f"{HOST_BEAT_ENV} = {value!r}: expected SLOT:PATH")
        return cls(BeatBoard.attach(path), int(slot))

    def claim(self, worker_id: int) -> None:
        self.board.claim(self.slot, worker_id)

    def beat(self) -> None:
        self.board.beat(self.slot)

    def agent_call_since(self) -> float | None:
        return self.board.call_since()

    def agent_behind(self, interval_s: float) -> bool:
        """Whether the agent has not passed the beats on for ``BEHIND_INTERVALS`` intervals (or ever): the worker
        then sends its own."""
        passed = self.board.passed_at()
        return passed is None or time.monotonic() - passed > BEHIND_INTERVALS * interval_s

    def passed_since(self, at: float) -> bool:
        """Whether the agent has passed on every beat counted before ``at`` (a ``time.monotonic()`` taken after
        the beat): a look that began at ``at`` or later is over."""
        passed = self.board.passed_at()
        return passed is not None and passed >= at


class _Process(Protocol):
    def poll(self) -> int | None: ...


def pass_stamp(previous: int) -> int:
    """A value for the heartbeat keys of one look: microseconds since the epoch, above ``previous``."""
    return max(time.time_ns() // 1000, previous + 1)


class HostBeats:
    """The agent's side: a board (``env_for_new_process`` and ``bind`` hand out its slots) and, once it
    ``follow``s a coordinator, a thread that passes the beats on ``LOOKS_PER_INTERVAL`` times every ``interval_s``
    (the workers' heartbeat interval), on a connection of its own
    whose calls time out after ``op_timeout_s``."""

    def __init__(self, interval_s: float, op_timeout_s: float, slots: int = DEFAULT_SLOTS) -> None:
        self.interval_s, self.op_timeout_s = interval_s, op_timeout_s
        self.board = BeatBoard.create(slots)
        self._owners: dict[int, _Process] = {}  # slot -> the process given it (the agent's thread only)
        self._lock = threading.Lock()
        self._generation = 0  # coordinators followed so far: the thread of an older one writes nothing
        self._tunnel: Tunnel | None = None
        self._closed = threading.Event()

    def env_for_new_process(self) -> str:
        """``HOST_BEAT_ENV``'s value for a process about to start (``bind`` it once started): the first slot no
        live process holds, emptied. RuntimeError if every slot is held."""
        for slot in range(self.board.slots):
            owner = self._owners.get(slot)
            if owner is None or owner.poll() is not None:
                self._owners.pop(slot, None)
                self.board.reset(slot)
                return f"{slot}:{self.board.path}"
        raise RuntimeError(f"host heartbeats: all {self.board.slots} slots are held by live processes")

    def bind(self, value: str, process: _Process) -> None:
        """``process`` was started with ``HOST_BEAT_ENV = value``: its slot is not given again while it lives."""
        self._owners[int(value.partition(":")[0])] = process

    def follow(self, address: str, token: str) -> None:
        """Pass the beats to the coordinator at ``address`` from now on (the previous one's thread stops)."""
        with self._lock:
            self._generation += 1
            generation = self._generation
            if self._tunnel is not None:
                self._tunnel.cut()
        threading.Thread(
            target=self._run, args=(address, token, generation), name=f"host-beats-{generation}", daemon=True
        ).start()

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            self._generation += 1
            if self._tunnel is not None:
                self._tunnel.cut()
        shutil.rmtree(os.path.dirname(self.board.path), ignore_errors=True)

    def moved(self, seen: dict[int, int]) -> list[int]:
        """The worker ids whose slot's count changed since ``seen`` (slot -> count, updated)."""
        ids = set()
        for slot in range(self.board.slots):
            worker_id, count = self.board.read(slot)
            if count and seen.get(slot) != count:
                seen[slot] = count
                if worker_id != NO_WORKER:
                    ids.add(worker_id)
        return sorted(ids)

    def _run(self, address: str, token: str, generation: int) -> None:
        """Pass the beats on until another coordinator is followed; a connection that fails, or a call that
        takes longer than ``op_timeout_s`` (cut by its guard: a peer the network no longer reaches neither
        answers nor resets), is opened again while this coordinator is the one followed."""
        guard = CallGuard(self.op_timeout_s)
        try:
            self._connect_and_pass_on(address, token, generation, guard)
        finally:
            guard.close()

    def _connect_and_pass_on(self, address: str, token: str, generation: int, guard: CallGuard) -> None:
        while generation == self._generation and not self._closed.is_set():
            try:
                self.board.call_began(time.monotonic())
                # Connected with the long timeout, as a worker's own connections are: opening one can take seconds
                # on a loaded host (the gateway's handshake), and a failed attempt only costs another.
                store, tunnel = open_store(address, token=token)
            except (TunnelError, RuntimeError, OSError) as e:
                log.warning("host heartbeats: cannot reach the coordinator at %s (%s)", address, e)
                self._closed.wait(self.interval_s)
                continue
            with self._lock:
                if generation != self._generation:
                    tunnel.close()
                    return
                self._tunnel = tunnel
            try:
                store.set_timeout(datetime.timedelta(seconds=self.op_timeout_s))
                self.board.call_ended()  # connected
                self._pass_on(store, tunnel, guard, generation)
            except RuntimeError as e:
                if generation == self._generation and not self._closed.is_set():
                    log.warning("host heartbeats: a call to the coordinator failed (%s); connecting again", e)
            finally:
                tunnel.close()

    def _pass_on(self, store: Any, tunnel: Tunnel, guard: CallGuard, generation: int) -> None:
        seen: dict[int, int] = {}
        stamp = 0
        next_look = time.monotonic()
        while generation == self._generation:
            look_began = time.monotonic()
            moved = self.moved(seen)
            if moved:
                stamp = pass_stamp(stamp)
                names, values = [keys.heartbeat(w) for w in moved], [str(stamp)] * len(moved)
                self.board.call_began(time.monotonic())
                guard.call(tunnel, lambda n=names, v=values: store.multi_set(n, v))
                self.board.call_ended()
            self.board.passed(look_began)
            next_look += self.interval_s / LOOKS_PER_INTERVAL
            delay = next_look - time.monotonic()
            if delay < 0:  # the call or this thread ran late: look again at once, then keep the pace from now
                next_look, delay = time.monotonic(), 0.0
            if self._closed.wait(delay):
                return
