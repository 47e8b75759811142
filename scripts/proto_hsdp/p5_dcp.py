"""Q5: checkpoints of the sharded state with torch.distributed.checkpoint (DCP) on CPU, resharded on load.

Phase A: 2 replicas x 2 shards train 2 exact steps (common.ReplicaRank); replica 0 alone saves (its 2 ranks,
  DCP's collectives on the replica's own process group: replicas hold identical state, one copy is enough).
  The state: the model's and AdamW's sharded state dicts (``get_state_dict``: DTensors), plus unbroken's
  replicated scalars (step, exact-mode bounds) as plain objects. A digest of the full state (parameters and both
  AdamW moments, gathered) is taken before saving.
Phase B: load the checkpoint into 3 replicas x 2 shards, 1 x 2, 1 x 4 and 1 x 1 (unsharded, no FSDP); every
  replica loads it independently with its own process group. Check the digest, then train steps 2 and 3 and
  compare the final parameters with the unsharded reference trained 4 steps straight (exact mode: bitwise).

    .venv/bin/python scripts/proto_hsdp/p5_dcp.py [--targets 3x2,1x2,1x4,1x1]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from common import Config, Launcher, ReplicaRank, Role, reference_worker  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402


def state_digest(rank: ReplicaRank) -> str:
    """sha256 of the full parameters and AdamW state (gathered inside the replica), step and bounds."""
    h = hashlib.sha256()
    for p in rank.params:
        ts = [p]
        st = rank.opt.state.get(p, {})
        ts += [st[k] for k in ("exp_avg", "exp_avg_sq") if k in st]
        for t in ts:
            t = t.full_tensor() if isinstance(t, DTensor) else t
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        if "step" in st:
            h.update(repr(float(st["step"])).encode())
    h.update(repr((rank.step, rank.scale.bound_exp if rank.scale else None)).encode())
    return h.hexdigest()


def save_worker(role: Role, store, port: int, cfg: dict, path: str) -> dict:  # noqa: ANN001
    rank = ReplicaRank(role, store, port, Config(**cfg))
    res = rank.run()
    digest = state_digest(rank)
    out = {
        "role": str(role),
        "replica": role.replica,
        "shard": role.shard,
        "digest": digest,
        "checksum": res["checksum"],
    }
    if role.replica == 0:
        model_sd, optim_sd = get_state_dict(rank.model, rank.opt)
        state = {
            "model": model_sd,
            "optim": optim_sd,
            "unbroken": {"step": rank.step, "bound_exp": list(rank.scale.bound_exp)},
        }
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path)  # the default group of this process = replica 0's ranks
        out["save_s"] = round(time.perf_counter() - t0, 3)
        out["save_local_mb"] = round(
            sum(v.to_local().numel() * 4 for v in model_sd.values() if isinstance(v, DTensor)) / 2**20, 3
        )
    return out


def load_worker(role: Role, store, port: int, cfg: dict, path: str) -> dict:  # noqa: ANN001
    rank = ReplicaRank(role, store, port, Config(**cfg))
    model_sd, optim_sd = get_state_dict(rank.model, rank.opt)  # materialises AdamW's state to load into
    state = {"model": model_sd, "optim": optim_sd, "unbroken": {"step": 0, "bound_exp": [0] * len(rank.params)}}
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=path)  # collectives on this replica's own group only
    set_state_dict(rank.model, rank.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_s = time.perf_counter() - t0
    rank.step = int(state["unbroken"]["step"])
    rank.scale.bound_exp = [int(b) for b in state["unbroken"]["bound_exp"]]
    rank._begin()
    digest = state_digest(rank)
    res = rank.run()  # continue to cfg.steps
    return {
        "role": str(role),
        "replica": role.replica,
        "shard": role.shard,
        "digest": digest,
        "checksum": res["checksum"],
        "load_s": round(load_s, 3),
        "types": sorted({type(v).__name__ for v in state["model"].values()}),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="3x2,1x2,1x4,1x1")
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="proto_p5_"))
    ckpt = out / "ckpt_step2"
    cfg = {"steps": 2, "M": 8, "exact": True}
    ref_l = Launcher(out / "ref")
    ref_l.publish(["0:1"])
    ref_l.spawn(reference_worker, Role(0, 0, 1), cfg={**cfg, "steps": 4})
    ref_l.wait_all(300)
    reference = ref_l.results()[0]["checksum"]

    saved = Launcher(out / "save").run(save_worker, 2, 2, cfg=cfg, path=str(ckpt))
    digest = {r["digest"] for r in saved}
    assert len(digest) == 1, digest
    digest = digest.pop()
    files = sorted(p.name for p in ckpt.iterdir())
    size = sum(p.stat().st_size for p in ckpt.iterdir())
    print(
        f"saved by replica 0 of 2x2 at step 2: {files} ({size / 2**20:.2f} MiB), "
        f"save {max(r.get('save_s', 0) for r in saved)} s; state digest {digest[:16]}"
    )
    ok = True
    for target in a.targets.split(","):
        r, k = (int(x) for x in target.split("x"))
        res = Launcher(out / f"load_{target}").run(load_worker, r, k, cfg={**cfg, "steps": 4}, path=str(ckpt))
        same_state = all(x["digest"] == digest for x in res)
        same_final = all(x["checksum"] == reference for x in res)
        ok &= same_state and same_final
        print(
            f"loaded into {target} ({len(res)} ranks, load {max(x['load_s'] for x in res)} s, "
            f"state dict holds {res[0]['types']}): state digest equal: {same_state}; after steps 2-3 the params "
            f"are bitwise the unsharded 4-step reference: {same_final}"
        )
    print(f"\nall loads exact: {ok}")


if __name__ == "__main__":
    main()
