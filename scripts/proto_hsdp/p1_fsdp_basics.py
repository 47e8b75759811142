"""Q1: FSDP2 (``fully_shard``) on CPU / gloo, a shard-only mesh per replica, the replicate dimension ours.

R replicas x k ranks (default 2 x 2 = 4 processes). Each replica's k ranks form their own default process group
and a 1-D device mesh of device_type "cpu"; FSDP2 shards the tiny Transformer over it (reduce-scatter inside
the replica only). Across replicas, shard j of every replica is reduced on an unbroken FT group (``comm.form_group``
under the store prefix ``shard<j>/``, bounded polled waits). Checks, per rank:

  1. the parameters and gradients are DTensors Shard(0) on a "cpu" mesh; ``grad.to_local()`` is the shard;
  2. layout: the local shard is ``torch.chunk(full, k, dim=0)[j]`` (FSDP pads the last one), so shard j holds
     the same elements on every replica (compared by the parent through checksums);
  3. accumulation over 4 microbatches, (A) FSDP reduce-scatters each backward and accumulates the fp32 shard,
     (B) ``set_requires_gradient_sync(False)`` + ``set_reshard_after_backward(False)`` on all but the last
     backward (no communication, unsharded gradients kept), counting FSDP's all-gathers and reduce-scatters;
  4. determinism: variant A run twice from the same state gives the same bits (the intra-replica reduce-scatter
     is reproducible), and every replica ends with the same reduced shard;
  5. the local shard is replaced by the cross-replica sum, AdamW steps on the sharded parameters; the result
     is compared with an unsharded fp32 reference computed in the same process (allclose, not bitwise);
  6. probes: gloo's reduce-scatter in fp32, fp64 and int64, AVG and PREMUL_SUM; FSDP's divide factor without
     force-sum, and ``MixedPrecisionPolicy(reduce_dtype=torch.int64)``.

    .venv/bin/python scripts/proto_hsdp/p1_fsdp_basics.py [--replicas 2] [--k 2]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import (  # noqa: E402
    Launcher,
    build_model,
    local,
    local_checksum,
    loss_of,
    microbatch,
    shard_model,
)
from torch.distributed import PrefixStore, TCPStore  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from unbroken.ft import comm  # noqa: E402

PER_RANK = 4  # microbatches per rank per step


class Counter:
    """Counts FSDP's collectives (FSDP calls dist.all_gather_single / reduce_scatter_single by attribute)."""

    def __init__(self) -> None:
        self.n = {"all_gather": 0, "reduce_scatter": 0}
        ag, rs = dist.all_gather_single, dist.reduce_scatter_single

        def all_gather_single(*a, **kw):  # noqa: ANN002, ANN003
            self.n["all_gather"] += 1
            return ag(*a, **kw)

        def reduce_scatter_single(*a, **kw):  # noqa: ANN002, ANN003
            self.n["reduce_scatter"] += 1
            return rs(*a, **kw)

        dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single

    def take(self) -> dict[str, int]:
        out, self.n = dict(self.n), {"all_gather": 0, "reduce_scatter": 0}
        return out


def probes(mesh) -> dict:  # noqa: ANN001
    """What gloo and FSDP2's own knobs do for the exact mode (each on a fresh 4 x 4 Linear)."""
    out: dict = {}
    k = dist.get_world_size()
    for dt in (torch.float32, torch.float64, torch.int64):
        o = torch.empty(2, dtype=dt)
        dist.reduce_scatter_single(output=o, input=torch.ones(2 * k, dtype=dt))
        out[f"gloo reduce_scatter {dt}"] = f"ok {o.tolist()}"
    for name, op in (("AVG", dist.ReduceOp.AVG), ("PREMUL_SUM", dist._make_nccl_premul_sum(0.5))):
        t = torch.ones(2)
        try:
            dist.all_reduce(t, op=op)
            out[f"gloo all_reduce {name}"] = f"ok {t.tolist()}"
        except RuntimeError as e:
            out[f"gloo all_reduce {name}"] = f"fails: {str(e).splitlines()[0][:80]}"
    for case in ("set_gradient_divide_factor(1.0) alone", "MixedPrecisionPolicy(reduce_dtype=int64)"):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 4, bias=False)
        int64 = "int64" in case
        fully_shard(m, mesh=mesh, **({"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.int64)} if int64 else {}))
        if not int64:
            m.set_gradient_divide_factor(1.0)
        try:
            m(torch.full((1, 4), 0.3)).sum().backward()
            out[case] = f"ok, grad dtype {m.weight.grad.dtype}"
        except (RuntimeError, TypeError) as e:
            out[case] = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
    return out


def my_ids(replica: int, shard: int, k: int) -> list[int]:
    base = (replica * k + shard) * PER_RANK
    return list(range(base, base + PER_RANK))


def worker(role, store: TCPStore, port: int, n_replicas: int) -> dict:  # noqa: ANN001
    k, j, a = role.k, role.shard, role.replica
    replicas = n_replicas
    M = replicas * k * PER_RANK
    out: dict = {"role": str(role), "replica": a, "shard": j}
    dist.init_process_group(
        "gloo", store=PrefixStore(f"replica{a}", store), rank=j, world_size=k, timeout=datetime.timedelta(seconds=30)
    )
    mesh = init_device_mesh("cpu", (k,), mesh_dim_names=("shard",))
    model = build_model()
    units = shard_model(model, mesh)
    for u in units:  # SUM semantics (the loss is already divided by M); gloo has no PREMUL_SUM
        u.set_force_sum_reduction_for_comms(True)
        u.set_gradient_divide_factor(1.0)
    params = list(model.parameters())
    out["probes"] = probes(mesh)
    counter = Counter()

    # 1 + 2: types and layout
    p0 = model.tok_embeddings.weight
    out["param_type"] = (
        f"{type(p0).__name__} {p0.placements} mesh={p0.device_mesh.device_type}{tuple(p0.device_mesh.shape)}"
    )
    layout_ok = True
    for p in params:
        full = p.full_tensor()
        layout_ok &= torch.equal(local(p), torch.chunk(full, k, dim=0)[j])
    out["layout_is_chunk_j"] = layout_ok
    out["local_shapes"] = {
        n: list(local(p).shape)
        for n, p in list(model.named_parameters())[:3] + [("output.weight", model.output.weight)]
    }
    out["param_shard_sha"] = local_checksum(params)

    def accumulate(variant: str) -> dict[str, int]:
        for p in params:
            p.grad = None
        ids = my_ids(a, j, k)
        for i, mb in enumerate(ids):
            last = i == len(ids) - 1
            if variant == "B":
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            (loss_of(model, microbatch(0, mb)) / M).backward()
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        return counter.take()

    counter.take()
    out["collectives_A"] = accumulate("A")
    g_a = [local(p.grad).clone() for p in params]
    out["grad_type"] = f"{type(p0.grad).__name__} {p0.grad.placements} local {tuple(p0.grad.to_local().shape)}"
    out["collectives_A_again"] = accumulate("A")
    out["A_repeat_bitwise"] = all(torch.equal(x, local(p.grad)) for x, p in zip(g_a, params, strict=False))
    out["collectives_B"] = accumulate("B")
    g_b = [local(p.grad).clone() for p in params]
    out["A_vs_B_bitwise"] = all(torch.equal(x, y) for x, y in zip(g_a, g_b, strict=False))
    out["A_vs_B_max_abs"] = max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(g_a, g_b, strict=True))

    # 5: the cross-replica reduction of the shard on the FT group of shard j (unbroken.ft.comm)
    for p, g in zip(params, g_a, strict=False):
        local(p.grad).copy_(g)
    group, status = comm.form_group(
        PrefixStore(f"shard{j}", store), 1, list(range(replicas)), a, "gloo", 30.0, torch.device("cpu")
    )
    assert group is not None, status
    flat = torch.cat([local(p.grad).reshape(-1) for p in params])
    st = comm.wait_all([comm.allreduce_async(group, flat)], 30.0, lambda: False)
    assert st, st
    off = 0
    for p in params:
        n = local(p.grad).numel()
        local(p.grad).copy_(flat[off : off + n].view_as(local(p.grad)))
        off += n
    out["reduced_grad_shard_sha"] = local_checksum([p.grad for p in params])
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    opt.step()
    out["after_step_shard_sha"] = local_checksum(params)
    out["optimizer_state_type"] = type(opt.state[p0]["exp_avg"]).__name__

    # reference: the unsharded fp32 gradient of all M microbatches, then the same AdamW step, sliced to shard j
    ref = build_model()
    for mb in range(M):
        (loss_of(ref, microbatch(0, mb)) / M).backward()
    ref_grad_diff = max(
        float((torch.chunk(q.grad, k, dim=0)[j] - local(p.grad)).abs().max()) if local(p.grad).numel() else 0.0
        for q, p in zip(ref.parameters(), params, strict=False)
    )
    torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1).step()
    out["grad_vs_unsharded_max_abs"] = ref_grad_diff
    out["param_vs_unsharded_max_abs"] = max(
        float((torch.chunk(q.detach(), k, dim=0)[j] - local(p).detach()).abs().max()) if local(p).numel() else 0.0
        for q, p in zip(ref.parameters(), params, strict=False)
    )
    out["full_tensor_is_DTensor_collective"] = isinstance(p0, DTensor)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--k", type=int, default=2)
    a = ap.parse_args()
    launcher = Launcher(tempfile.mkdtemp(prefix="proto_p1_"))
    results = launcher.run(worker, a.replicas, a.k, n_replicas=a.replicas)
    for r in results:
        print(f"--- {r['role']}")
        for key, val in r.items():
            if key not in ("role", "replica", "shard"):
                print(f"  {key}: {val}")
    by_shard: dict[int, list[dict]] = {}
    for r in results:
        by_shard.setdefault(r["shard"], []).append(r)
    print("\nacross replicas, per shard index:")
    for j, rs in sorted(by_shard.items()):
        for key in ("param_shard_sha", "reduced_grad_shard_sha", "after_step_shard_sha"):
            vals = {r[key] for r in rs}
            print(f"  shard {j} {key}: {'identical on all replicas' if len(vals) == 1 else 'DIFFERENT ' + str(vals)}")


if __name__ == "__main__":
    main()
