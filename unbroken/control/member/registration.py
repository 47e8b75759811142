"""A worker's admission: the registration request it sends the coordinator, and the answer it reads back.

Owns the request's fields (``worker_id``, ``host``, ``pid``, ``returning``, ``fingerprint``, a new process's
start cost, a promoted spare's index) and how the answer is read (``keys.register_id``, ``keys.register_late``,
``keys.refused``). The same call admits a worker at its start and re-admits it, ``returning``, by a coordinator
that replaced a dead one (``control.member.reconnect``).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from typing import Any

from torch.distributed import TCPStore

from unbroken.control.member.env import FORKED_ENV, STARTED_AT_ENV
from unbroken.control.store import keys
from unbroken.control.store.connect import STORE_TIMEOUT_S, ring


class Refused(Exception):
    """The coordinator keeps this worker out of the membership; the message is the one line saying why."""


def start_cost() -> dict[str, Any]:
    """What this process's start cost until now: ``start_s``, the wall time since its agent asked for it (None if
    no agent said when), ``start_cpu_s``, the CPU this process used (a forked process starts from zero), and
    ``forked``."""
    asked = os.environ.get(STARTED_AT_ENV)
    try:
        start_s: float | None = round(time.time() - float(asked), 4) if asked else None
    except ValueError:
        start_s = None
    return {
        "start_s": start_s,
        "start_cpu_s": round(time.process_time(), 4),
        "forked": os.environ.get(FORKED_ENV) == "1",
    }


def register(
    store: TCPStore, worker_id: int | None, returning: bool, fingerprint: dict[str, str], spare: int | None = None
) -> tuple[int, bool]:
    """Ask the coordinator for admission; (the admitted id, whether this worker joins a running job).

    ``worker_id`` None: the coordinator picks. ``returning``: a member of the job whose coordinator was replaced
    (it holds the state; no start cost is sent). ``spare``: the warm spare this process was (the coordinator admits
    it without the joiners' last call). Raises ``Refused`` when the coordinator keeps the worker out, RuntimeError
    when the store call fails or no answer comes within ``STORE_TIMEOUT_S``."""
    seq = store.add(keys.REGISTER_SEQ, 1)
    request = {
        "worker_id": -1 if worker_id is None else worker_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "returning": returning,
        "fingerprint": fingerprint,
        **({} if returning else start_cost()),
        **({} if spare is None else {"spare": spare}),
    }
    store.set(keys.register(seq), json.dumps(request))
    ring(store)
    store.wait([keys.register_id(seq)], datetime.timedelta(seconds=STORE_TIMEOUT_S))
    admitted = int(store.get(keys.register_id(seq)))
    if store.check([keys.refused(admitted)]):
        raise Refused(store.get(keys.refused(admitted)).decode())
    return admitted, store.get(keys.register_late(seq)) == b"1"
