"""Which store keeps the coordinator's hard state: ``--coordinator.state`` (``journal`` or ``etcd://...``) to a
``StateStore`` (``durable.JournalStore`` or ``etcd.EtcdStateStore``, imported only when etcd is used)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from unbroken.control.store.durable import JournalStore, StateStore


def open_state_store(spec: str, run_dir: Path, candidate: str, lease_s: float = 5.0) -> StateStore:
    """The store ``--coordinator.state`` names: ``journal`` (the default, one host) or
    ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` (several hosts; the prefix defaults to
    ``/unbroken/<run directory name>``). ``candidate`` identifies this coordinator in an election (its
    public address, so that clients can find the leader). Raises ValueError for anything else."""
    if spec == "journal":
        return JournalStore(run_dir)
    if spec.startswith("etcd://"):
        from unbroken.control.store.etcd import EtcdStateStore, parse_etcd_url  # etcd3gw only when etcd is used

        endpoints, prefix = parse_etcd_url(spec)
        lease = timedelta(seconds=max(1, round(lease_s)))
        return EtcdStateStore(endpoints, prefix or f"/unbroken/{Path(run_dir).name}", candidate, lease_ttl=lease)
    raise ValueError(f"coordinator.state = {spec!r}: expected 'journal' or 'etcd://host:port[,host:port...]'")
