"""Q2: exact mode on shards. Is the trained model the same bits for R replicas x k FSDP2 shards as unsharded?

Each rank's microbatch gradient is quantised to int64 fixed point (unbroken's per-tensor power-of-two scale)
inside FSDP2's reduce-scatter hook, before any float addition; the intra-replica reduce-scatter then runs in
int64 on gloo, the int64 shard is accumulated over the step's rounds, and reduced across replicas on the
shard's FT group. The norm for clipping is computed in int64 fixed point too (layout-independent).

Runs, one after the other (at most 4 processes at a time), 3 steps of AdamW on the tiny Transformer, M = 8:
  reference 1x1: unbroken's GradientReducer(exact=True) on the plain model (no FSDP), one process
  2x1, 1x2, 2x2, 1x4 (replicas x shards) through the prototype's FT layer
  and the same in fp32 mode (FSDP's SUM reduce-scatter, fp32 accumulation): expected to differ.
  --overflow: start the bounds at 2^-12 so step 0 overflows and is redone with grown bounds.

    .venv/bin/python scripts/proto_hsdp/p2_exact.py [--steps 3] [--overflow] [--configs 2x2,1x2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Launcher, Role, reference_worker, replica_worker  # noqa: E402


def run_config(name: str, cfg: dict, out: Path) -> tuple[str, list[dict], float]:
    t0 = time.perf_counter()
    launcher = Launcher(out / name.replace(" ", "_"))
    if name.startswith("ref"):
        launcher.publish(["0:1"])
        launcher.spawn(reference_worker, Role(0, 0, 1), cfg=cfg)
        launcher.wait_all(300)
        results = launcher.results()
    else:
        r, k = (int(x) for x in name.split()[0].split("x"))
        results = launcher.run(replica_worker, r, k, cfg=cfg)
    checksums = {res["checksum"] for res in results}
    assert len(checksums) == 1, f"{name}: ranks disagree: {checksums}"
    return checksums.pop(), results, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--overflow", action="store_true")
    ap.add_argument("--configs", default="ref,2x1,1x2,2x2,1x4")
    ap.add_argument("--no-fp32", action="store_true")
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="proto_p2_"))
    base = {"steps": a.steps, "M": 8}
    if a.overflow:
        base["initial_bound_exp"] = -12
    modes = [("exact", True)] + ([] if a.no_fp32 else [("fp32", False)])
    table = []
    for mode, exact in modes:
        for c in a.configs.split(","):
            name = "ref 1x1" if c == "ref" else f"{c} {mode}"
            if c == "ref":
                name = f"ref 1x1 {mode}"
            checksum, results, secs = run_config(name, {**base, "exact": exact}, out)
            hist = results[0]["history"]
            events = sorted({e for r in results for e in r.get("events", []) if "overflow" in e})
            table.append((mode, name, checksum, hist, secs, events))
            print(
                f"{name:16s} params sha256 {checksum[:16]}  losses {[round(h['loss'], 6) for h in hist]}  "
                f"norms {[round(h['norm'], 6) for h in hist]}  ({secs:.1f} s)"
                f"{'  ' + '; '.join(events) if events else ''}",
                flush=True,
            )
    print()
    for mode, _ in modes:
        rows = [t for t in table if t[0] == mode]
        ref = rows[0][2]
        same = [t[1] for t in rows if t[2] == ref]
        diff = [t[1] for t in rows if t[2] != ref]
        print(f"{mode}: bitwise equal to {rows[0][1]}: {same}; different: {diff}")


if __name__ == "__main__":
    main()
