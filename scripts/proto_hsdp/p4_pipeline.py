"""Q4: ``torch.distributed.pipelining`` on CPU / gloo: a replica is a 2-stage pipeline; the FT reduction per stage.

R replicas x 2 stages (default 2 x 2 = 4 processes). Stage 0 = token embedding + block 0, stage 1 = block 1 +
final norm + output, cut out of the same ``Transformer`` (same parameters, same init). Each step the planner
(``unbroken.core.plan.plan_ids``) gives each replica its microbatch ids; the replica's batch is their
concatenation, and the schedule (``ScheduleGPipe`` or ``Schedule1F1B``, ``n_microbatches`` = the replica's quota,
``scale_grads=False``: the loss is divided by the step's M as unbroken does) runs them as its microbatches, so
pipeline microbatch i *is* id ``ids[i]``. Odd steps use an uneven split (throughput quotas 5 / 3), so a
schedule is built per distinct quota.

Exact mode: a post-accumulate-grad hook on each stage parameter folds every microbatch's gradient into the
stage's int64 accumulator as the schedule's backward produces it (as ``GradientReducer``'s armed hooks do), so
the fold does not depend on the schedule's order. After ``schedule.step`` the stage's accumulator is all-reduced
across replicas on the FT group of that stage (stage s of every replica; ``comm.form_group`` under the store
prefix ``stage<s>/``). The clip norm is exact and summed over the stages inside the replica. The result must
be bitwise equal to the unsharded reference (unbroken's GradientReducer, one process).

    .venv/bin/python scripts/proto_hsdp/p4_pipeline.py [--schedule 1f1b|gpipe] [--replicas 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import (
    Launcher,
    Role,
    build_model,
    exact_clip_and_track,
    microbatch,
    named_checksums,
    peak_rss_mb,
    reference_worker,
)  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed import PrefixStore  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # noqa: E402

from unbroken.core.config import Workload  # noqa: E402
from unbroken.core.plan import plan_ids  # noqa: E402
from unbroken.ft import comm  # noqa: E402
from unbroken.ft.exact import FixedPointScale  # noqa: E402

M = 8


class Stage0(nn.Module):
    def __init__(self, full: nn.Module) -> None:
        super().__init__()
        self.tok_embeddings, self.layer = full.tok_embeddings, full.layers[0]
        self.register_buffer("freqs_cis", full.freqs_cis, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layer(self.tok_embeddings(tokens), self.freqs_cis[: tokens.shape[1]])


class Stage1(nn.Module):
    def __init__(self, full: nn.Module) -> None:
        super().__init__()
        self.layer, self.norm, self.output = full.layers[1], full.norm, full.output
        self.register_buffer("freqs_cis", full.freqs_cis, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(self.layer(h, self.freqs_cis[: h.shape[1]]))).float()


def worker(role: Role, store, port: int, schedule: str, n_replicas: int, steps: int) -> dict:  # noqa: ANN001
    s, a = role.shard, role.replica  # "shard" is the stage index here
    dist.init_process_group(
        "gloo", store=PrefixStore(f"replica{a}", store), rank=s, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    full = build_model()
    names = [n for n, _ in full.named_parameters()]
    stage_mod = Stage0(full) if s == 0 else Stage1(full)
    mine = {id(p) for p in stage_mod.parameters()}
    all_params = list(full.parameters())
    owned = [p for p in all_params if id(p) in mine]  # in the full model's order
    stage = PipelineStage(stage_mod, stage_index=s, num_stages=2, device=torch.device("cpu"))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1)) / M

    schedules: dict[int, object] = {}
    scale = FixedPointScale(len(all_params), M)  # every tensor of the model; this stage uses its own
    offsets, size = {}, 0
    for p in owned:
        offsets[id(p)] = size
        size += p.numel()
    acc = torch.zeros(size, dtype=torch.int64)
    exps = {"e": scale.exponents()}
    idx = {id(p): i for i, p in enumerate(all_params)}
    folds = {"n": 0}

    def hook(p: torch.Tensor) -> None:  # one microbatch's gradient of p, as the schedule's backward makes it
        e = exps["e"][idx[id(p)]]
        g = p.grad.reshape(-1)
        assert float(g.abs().max()) * 2.0**e < scale.limit, "overflow (grow rule omitted in this prototype)"
        acc[offsets[id(p)] : offsets[id(p)] + p.numel()] += g.mul(2.0**e).round_().long()
        p.grad = None
        folds["n"] += 1

    for p in owned:
        p.register_post_accumulate_grad_hook(hook)
    group, status = comm.form_group(
        PrefixStore(f"stage{s}", store), 1, list(range(n_replicas)), a, "gloo", 60.0, torch.device("cpu")
    )
    assert group is not None, status
    opt = torch.optim.AdamW(owned, lr=1e-3, weight_decay=0.1)
    times, quotas = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        speeds = {r: (1.0 if r == 0 else 1.7) for r in range(n_replicas)} if step % 2 else None
        plan = plan_ids(
            step, list(range(n_replicas)), range(M), M, Workload.THROUGHPUT if speeds else Workload.EVEN, speeds
        )
        ids = list(plan.ids_for(a))
        quotas.append(len(ids))
        if len(ids) not in schedules:
            # n_microbatches is fixed per schedule, and a PipelineStage keeps the buffers of the first schedule
            # that ran it (another count then fails: "Chunk id 3 is out of range"): one stage + schedule per quota
            st_q = (
                stage
                if not schedules
                else PipelineStage(stage_mod, stage_index=s, num_stages=2, device=torch.device("cpu"))
            )
            schedules[len(ids)] = cls(st_q, n_microbatches=len(ids), loss_fn=loss_fn, scale_grads=False)
        sched = schedules[len(ids)]
        acc.zero_()
        exps["e"] = scale.exponents()
        folds["n"] = 0
        batch = torch.cat([microbatch(step, j) for j in ids])
        if s == 0:
            sched.step(batch[:, :-1])
        else:
            losses: list = []
            sched.step(target=batch[:, 1:], losses=losses)
        assert folds["n"] == len(ids) * len(owned), (folds["n"], len(ids), len(owned))
        # the per-stage cross-replica reduction: stage s of every replica, unbroken's bounded wait
        reduced = acc.clone()
        st = comm.wait_all([comm.allreduce_async(group, reduced)], 60.0, lambda: False)
        assert st, st
        grads = []
        for p in all_params:
            if id(p) in mine:
                o = offsets[id(p)]
                p.grad = reduced[o : o + p.numel()].to(torch.float32).mul_(2.0 ** -exps["e"][idx[id(p)]]).view_as(p)
                grads.append(p.grad)
            else:
                grads.append(torch.zeros(0))
        exact_clip_and_track(
            grads,
            [p.numel() for p in all_params],
            lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX),
            lambda t: dist.all_reduce(t),
            1.0,
            scale,
        )
        opt.step()
        for p in owned:
            p.grad = None
        times.append(time.perf_counter() - t0)
    sha = named_checksums(full)
    return {
        "role": str(role),
        "replica": a,
        "shard": s,
        "stage_params": [n for n, p in zip(names, all_params, strict=False) if id(p) in mine],
        "param_sha": {n: sha[n] for n, p in zip(names, all_params, strict=False) if id(p) in mine},
        "quotas": quotas,
        "step_s": [round(t, 3) for t in times],
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="proto_p4_"))
    ref_l = Launcher(out / "ref")
    ref_l.publish(["0:1"])
    ref_l.spawn(reference_worker, Role(0, 0, 1), cfg={"steps": a.steps, "M": M, "exact": True})
    ref_l.wait_all(300)
    ref = ref_l.results()[0]["param_sha"]
    L = Launcher(out / "pp")
    results = L.run(worker, a.replicas, 2, schedule=a.schedule, n_replicas=a.replicas, steps=a.steps)
    equal = True
    for r in results:
        same = all(ref[n] == h for n, h in r["param_sha"].items())
        equal &= same
        print(
            f"{r['role'].replace('/s', '/stage')}: {len(r['stage_params'])} tensors ({r['stage_params'][0]} .. "
            f"{r['stage_params'][-1]}), quotas per step {r['quotas']}, step times {r['step_s']} s, "
            f"peak RSS {r['peak_rss_mb']} MB; params == unsharded reference: {same}"
        )
    covered = {n for r in results for n in r["param_sha"]}
    print(
        f"\n{a.schedule}, {a.replicas} replicas x 2 stages, {a.steps} steps: every parameter covered: "
        f"{covered == set(ref)}; all bitwise equal to the unsharded reference: {equal}"
    )


if __name__ == "__main__":
    main()
