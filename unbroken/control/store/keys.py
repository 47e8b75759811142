"""The coordinator's store: every key, who writes it and who reads it. The one place a key is spelled.

    key                       written by                   read by
    config                    coordinator (start)          workers: the resolved config (TOML)
    run_dir                   coordinator (start)          workers: where checkpoints go
    expected                  coordinator (start)          workers: the configured workers (MeCeFO's ring)
    resume                    coordinator (start)          workers: "1" when the run continues (--resume)
    incarnation               coordinator (start)          workers: which coordinator process this is (a
                                                           restarted one has another: workers re-register)
    register/seq              workers (add)                coordinator: registration requests so far
    register/<n>              a registering worker         coordinator: {worker_id, host, pid}
    register/<n>/id           coordinator                  that worker: its admitted id
    register/<n>/late         coordinator                  that worker: "1" if it joins a running job
    refused/<id>              coordinator                  that worker: why it may not join (exact mode: its
                                                           fingerprint differs from the group's)
    hb/<id>                   worker (add, heartbeats), or coordinator: a value that must keep moving
                              its agent (multi_set, comm.heartbeats = "host": control.member.hostbeat)
    dead/<id>                 launcher / agent             coordinator: the worker's process exited (why)
    deaths                    launcher / agent (add,       coordinator: dead/<id> keys written so far (it
                              after dead/<id>)             looks at them only when this moved)
    epoch                     coordinator                  workers, launcher: the newest epoch number
    epoch/<e>                 coordinator                  workers, launcher: {epoch, members, reason, reform}
    timeout/<e>/<id>          a worker                     coordinator: a collective of epoch e timed out
    timeouts                  a worker (add, after         coordinator: timeout/<e>/<id> keys written so far
                              timeout/<e>/<id>)            (it looks at them only when this moved)
    forming/<id>              a worker (forming a group)   its old group's members: it left that group for
                                                           the epoch written (never to return to it)
    metrics/seq, metrics/<n>  the leader, launcher, agent  coordinator: metrics records to append (JSON)
    final/<id>                workers (the run's end)      the leader: every member's parameter checksum
    done                      the leader                   everyone: the run finished
    stop                      anyone                       everyone: stop now (the reason)
    error/seq, error/<n>      a worker dying of an         coordinator: its exception, where it was raised
                              exception                    (core.records.WorkerError; the coordinator records
                                                           it and decides: control.coordinator.bugs)
    stop_saver                coordinator (a stop for a    that worker: save the state it holds before leaving
                              bug)
    stop_saved                that worker                  coordinator: which checkpoint is the last good one
    bell/seq, bell/<n>        anyone with news             coordinator: its doorbell (wake up and look)
    news/seq, news/<n>        coordinator                  workers: their doorbell (a new epoch or a stop)
    inject/<id>               a worker at a failure point  launcher / agent: deliver the scheduled signal
    injected/<id>             launcher / agent             coordinator: when the fault was delivered
    fired/<event>             launcher / agent, worker     workers: this scheduled event already fired
    skip/<id>                 launcher / agent             that worker: the event was not delivered
    pg/<e>/...                torch.distributed            the members of epoch e: their group's rendezvous
                                                           (pg/<e>/c<r>/...: rank r of every replica)
    replica/<a>/<inc>/...     torch.distributed            the ranks of replica a (incarnation inc): the
                                                           rendezvous of the replica's own process group
    spare/<k>                 launcher / agent             warm spare k: the id of the dead worker whose place
                                                           it takes (it waits for this key, initialised)
    spare-replica/<j>/<inc>/  torch.distributed            the ranks of spare replica j (spares j x size to
    ...                                                    j x size + size - 1): their process group's
                                                           rendezvous, formed before they take a replica's place

docs/library.md lists the same table for users.
"""

from __future__ import annotations

CONFIG = "config"
RUN_DIR = "run_dir"
EXPECTED = "expected"
RESUME = "resume"
INCARNATION = "incarnation"
REGISTER_SEQ = "register/seq"
EPOCH = "epoch"
METRICS_SEQ = "metrics/seq"
DONE = "done"
STOP = "stop"
ERROR_SEQ = "error/seq"
DEATHS = "deaths"
TIMEOUTS = "timeouts"
STOP_SAVER = "stop_saver"
STOP_SAVED = "stop_saved"


def register(n: int) -> str:
    return f"register/{n}"


def register_id(n: int) -> str:
    return f"register/{n}/id"


def register_late(n: int) -> str:
    return f"register/{n}/late"


def refused(worker: int) -> str:
    return f"refused/{worker}"


def heartbeat(worker: int) -> str:
    return f"hb/{worker}"


def forming(worker: int) -> str:
    return f"forming/{worker}"


def dead(worker: int) -> str:
    return f"dead/{worker}"


def spare(k: int) -> str:
    return f"spare/{k}"


def epoch(e: int) -> str:
    return f"epoch/{e}"


def timeout(e: int, worker: int) -> str:
    return f"timeout/{e}/{worker}"


def metrics(n: int) -> str:
    return f"metrics/{n}"


def final(worker: int) -> str:
    return f"final/{worker}"


def error(n: int) -> str:
    return f"error/{n}"


def doorbell_seq(bell: str) -> str:
    return f"{bell}/seq"


def doorbell(bell: str, n: int) -> str:
    return f"{bell}/{n}"


BELL = "bell"  # the coordinator's doorbell
NEWS = "news"  # the workers' doorbell


INJECT_BELL = "inject-bell"  # a count a worker adds 1 to once its injection key is set: its agent looks then


def inject(worker: int) -> str:
    return f"inject/{worker}"


def injected(worker: int) -> str:
    return f"injected/{worker}"


def fired(event: str) -> str:
    return f"fired/{event}"


def skip(worker: int) -> str:
    return f"skip/{worker}"


def group_prefix(e: int, coordinate: int | None = None) -> str:
    """The rendezvous of epoch ``e``'s group; with replicas of several ranks, one group per rank index."""
    return f"pg/{e}" if coordinate is None else f"pg/{e}/c{coordinate}"


def replica_prefix(replica: int, incarnation: str) -> str:
    """The rendezvous of one incarnation of a replica's own process group (its ranks' FSDP and pipeline)."""
    return f"replica/{replica}/{incarnation}"


def spare_replica_prefix(spare_replica: int, incarnation: str) -> str:
    """The rendezvous of a whole spare replica's own process group (it keeps it when it takes a replica's place)."""
    return f"spare-replica/{spare_replica}/{incarnation}"
