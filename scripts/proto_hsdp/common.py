"""Shared pieces of the issue-19 prototypes: a replica is k FSDP2 ranks, unbroken's FT layer reduces across replicas.

Not part of the package. Everything here runs on CPU with gloo, one process per rank, 1 intra-op thread each
(the machine has 2 cores). The pieces:

- ``Launcher``: the parent process hosts a TCPStore and starts ranks (``torch.multiprocessing``, spawn); it is
  also the prototypes' stand-in for unbroken's coordinator (it publishes membership epochs of replicas).
- the tiny model (``unbroken.train.model.Transformer``) and its data: microbatch ``id`` of step ``s`` is a pure
  function of (seed, s, id), as in unbroken.
- ``ShardFold``: a rank's local contribution, per gradient shard. Exact mode hooks FSDP2's reduce-scatter
  (``FSDPModule.set_custom_reduce_scatter``): each rank's microbatch gradient is quantised to int64 fixed point
  per tensor (unbroken's ``FixedPointScale``) *before* the intra-replica reduce-scatter, which then runs in
  int64 and is exact; the int64 shard is accumulated over the step's rounds.
- ``ReplicaRank``: one rank's side of the step protocol with replicas: plan over replicas, compute in rounds
  of k microbatches, reduce the shard across replicas on the shard's FT group (``unbroken.ft.comm``), agree
  inside the replica, commit; recover (re-form per-shard groups, state shard by shard, re-plan lost ids).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed import PrefixStore, TCPStore  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # noqa: E402  (the type the public setter takes)
from torch.distributed.tensor import DTensor  # noqa: E402

from unbroken.core.flavours import ModelArgs  # noqa: E402
from unbroken.core.plan import plan_ids  # noqa: E402
from unbroken.ft import comm  # noqa: E402
from unbroken.ft.exact import FixedPointScale  # noqa: E402
from unbroken.ft.sidevec import SideVector  # noqa: E402
from unbroken.train.model import Transformer  # noqa: E402

# vocab 257: the embedding and output rows do not split evenly over 2 or 4 ranks (FSDP pads the last shard)
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=257, ffn_hidden=96, max_seq_len=32)
MB_BATCH, MB_SEQ = 2, 16
SEED = 7
EXIT_EXCLUDED = 3  # as unbroken's EXIT_STOPPED: this rank's replica was removed from the membership


def log(role: Any, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} {role}] {msg}", flush=True)


# -- model and data ---------------------------------------------------------------------------------------
def build_model(seed: int = 1234, args: ModelArgs | None = None) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args or ARGS)


def microbatch(step: int, mb: int, seed: int = SEED, args: ModelArgs | None = None) -> torch.Tensor:
    """Tokens (B, T + 1) of microbatch ``mb`` of step ``step``: a pure function of (seed, step, mb)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + mb)
    return torch.randint(0, (args or ARGS).vocab_size, (MB_BATCH, MB_SEQ + 1), generator=g)


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def shard_model(model: torch.nn.Module, mesh: Any, **kw: Any) -> list[FSDPModule]:
    """FSDP2 as torchtitan applies it: one unit per transformer block, the root holds the rest."""
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's part of a tensor (the local shard of a DTensor, the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_checksum(model: torch.nn.Module) -> str:
    """sha256 of the full (gathered) parameters, in registration order: a collective inside the replica."""
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def named_checksums(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of each full parameter by name (a collective inside the replica for DTensors)."""
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[n] = hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def local_checksum(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(local(t).detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cpu_seconds() -> float:
    """CPU time of this process so far, all threads (user + system)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# -- launching ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Role:
    replica: int
    shard: int
    k: int  # ranks per replica (the FSDP shard degree)
    incarnation: int = 1

    def __str__(self) -> str:
        return f"r{self.replica}.{self.incarnation}/s{self.shard}"

    @property
    def key(self) -> str:
        return f"{self.replica}:{self.incarnation}"


def _child(target: Callable[..., Any], role: Role, port: int, out: str, kwargs: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    try:
        result = target(role, store, port, **kwargs)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    if result is not None:
        Path(out, f"{role.replica}.{role.incarnation}.{role.shard}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo groups of dead peers would block their destructors)


class Launcher:
    """The parent: hosts the store, starts ranks, and publishes membership epochs (the coordinator's job)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        for f in self.out.glob("*.json"):
            f.unlink()
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.port = self.store.port
        self.ctx = mp.get_context("spawn")
        self.procs: dict[Role, Any] = {}
        self.epoch = 0

    def publish(self, members: list[str]) -> int:
        """A new membership epoch: the replicas (``replica:incarnation``) that take part from now on."""
        self.epoch += 1
        self.store.set(f"members/{self.epoch}", ",".join(members))
        self.store.set("epoch", str(self.epoch))
        return self.epoch

    def spawn(self, target: Callable[..., Any], role: Role, **kwargs: Any) -> None:
        p = self.ctx.Process(target=_child, args=(target, role, self.port, str(self.out), kwargs), daemon=False)
        p.start()
        self.procs[role] = p

    def run(self, target: Callable[..., Any], replicas: int, k: int, timeout_s: float = 300, **kwargs: Any) -> list:
        """Start replicas x k ranks of ``target``, wait, return their results (sorted by replica, shard)."""
        self.publish([f"{r}:1" for r in range(replicas)])
        for r in range(replicas):
            for j in range(k):
                self.spawn(target, Role(r, j, k), **kwargs)
        self.wait_all(timeout_s)
        return self.results()

    def wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for role, p in self.procs.items():
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                raise RuntimeError(f"{role} did not finish in {timeout_s} s")
        bad = {str(r): p.exitcode for r, p in self.procs.items() if p.exitcode != 0}
        if bad:
            raise RuntimeError(f"ranks failed: {bad}")

    def results(self) -> list[dict[str, Any]]:
        return [json.loads(f.read_text()) for f in sorted(self.out.glob("*.json"))]


# -- membership as a rank sees it ---------------------------------------------------------------------------
class Membership:
    """A watcher thread on the coordinator's epochs (unbroken: ``CoordinatorClient``'s cached epoch).

    Once this rank's replica has been a member, an epoch without it means the replica was declared dead
    (a replica-mate died): the rank ends at once with ``os._exit`` -- its FSDP collectives may be blocked in
    gloo on the dead peer and cannot be unwound in-process, so exiting is what bounds them."""

    POLL_S = 0.01

    def __init__(self, port: int, role: Role) -> None:
        self.role = role
        self.store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        self.members: dict[int, tuple[str, ...]] = {}
        self.latest = 0
        self.joined = False
        self.excluded_at: float | None = None
        self._lock = threading.Lock()
        self._poll()
        threading.Thread(target=self._run, name="membership", daemon=True).start()

    def _poll(self) -> None:
        e = int(self.store.get("epoch").decode())
        if e > self.latest:
            for x in range(self.latest + 1, e + 1):
                self.members[x] = tuple(self.store.get(f"members/{x}").decode().split(","))
            with self._lock:
                self.latest = e
            if self.joined and self.role.key not in self.members[e]:
                log(self.role, f"epoch {e} excludes replica {self.role.key}: leaving (exit {EXIT_EXCLUDED})")
                self.store.set(f"exit/{self.role}", repr(time.time()))
                sys.stdout.flush()
                os._exit(EXIT_EXCLUDED)

    def _run(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - the parent (coordinator) is gone: the run is over
                os._exit(4)

    def removed_since(self, epoch: int, members: tuple[str, ...]) -> bool:
        latest = self.latest
        return latest > epoch and not set(members) <= set(self.members[latest])

    def members_of(self, epoch: int) -> tuple[str, ...]:
        while epoch not in self.members:
            time.sleep(self.POLL_S)
        return self.members[epoch]

    def wait_for(self, after: int, timeout_s: float = 60.0) -> int:
        """The newest epoch after ``after`` that includes this replica."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            e = self.latest
            if e > after and self.role.key in self.members[e]:
                return e
            time.sleep(self.POLL_S)
        raise RuntimeError(f"no epoch after {after} including {self.role.key}")


# -- the local contribution, per shard ------------------------------------------------------------------------
@dataclass
class Segment:
    """One parameter's place in the flat shard buffer (FSDP's reduce-scatter layout, per FSDP unit)."""

    index: int  # in model.parameters()
    offset: int  # in the flat buffer of all this rank's shards
    padded: int  # elements of the padded shard (FSDP pads dim 0 to a multiple of k)
    numel: int  # elements of this rank's real shard (<= padded)
    full_numel: int


class ExactReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter, replaced (``set_custom_reduce_scatter``) by an exact one.

    FSDP hands over the flat fp32 input (k rows, one per destination rank, each the concatenation of the unit's
    padded parameter chunks) of this rank's microbatch gradient. Each parameter's columns are quantised with
    its power-of-two scale, the int64 rows are reduce-scattered inside the replica (gloo supports int64), and
    the int64 shard is added to the fold's accumulator. FSDP's own fp32 output is left zero: ``param.grad`` is
    written from the accumulator once the step's cross-replica reduction is done."""

    def __init__(self, fold: ShardFold, segments: list[Segment], start: int, size: int) -> None:
        self.fold, self.segments, self.start, self.size = fold, segments, start, size

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001
        fold = self.fold
        k = group.size()
        rows = input_tensor.view(k, -1)
        assert rows.shape[1] == self.size, "a parameter without gradient: use set_reduce_scatter_unused_params"
        q = torch.zeros(rows.shape, dtype=torch.int64)
        if not fold.padding:
            col = 0
            for s in self.segments:
                q[:, col : col + s.padded] = fold.quantise(s.index, rows[:, col : col + s.padded])
                col += s.padded
        out = torch.empty(self.size, dtype=torch.int64)
        fold.before_collective()
        dist.reduce_scatter_single(output=out, input=q.view(-1), group=group)
        fold.acc[self.start : self.start + self.size] += out
        output_tensor.zero_()
        return None


class ShardFold:
    """A rank's contribution to its shard of the step's gradient (exact: int64 accumulator; fp32: param.grad).

    ``k == 1`` (no FSDP): the rank holds whole tensors and folds after each backward, as unbroken's
    ``GradientReducer.fold`` does."""

    def __init__(self, model: torch.nn.Module, k: int, exact: bool, num_microbatches: int) -> None:
        self.params = list(model.parameters())
        self.k, self.exact, self.M = k, exact, num_microbatches
        self.segments: list[Segment] = []
        index = {id(p): i for i, p in enumerate(self.params)}
        offset = 0
        if k > 1:
            for mod in (m for m in model.modules() if isinstance(m, FSDPModule)):
                group = mod._get_fsdp_state()._fsdp_param_group  # private: the unit's parameters in FSDP's order
                if group is None:
                    continue
                start, segs = offset, []
                for fp in group.fsdp_params:
                    p = fp.sharded_param
                    seg = Segment(
                        index[id(p)], offset, fp.padded_sharded_param_size.numel(), local(p).numel(), p.numel()
                    )
                    segs.append(seg)
                    offset += seg.padded
                self.segments += segs
                mod.set_reduce_scatter_unused_params(True)  # the layout must not depend on which grads exist
                if exact:
                    mod.set_custom_reduce_scatter(ExactReduceScatter(self, segs, start, offset - start))
                else:  # fp32: SUM (the loss is already scaled by 1/M), never FSDP's average
                    mod.set_force_sum_reduction_for_comms(True)
                    mod.set_gradient_divide_factor(1.0)
        else:
            for i, p in enumerate(self.params):
                self.segments.append(Segment(i, offset, p.numel(), p.numel(), p.numel()))
                offset += p.numel()
        self.segments.sort(key=lambda s: s.index)
        self.size = offset
        self.acc = torch.zeros(offset, dtype=torch.int64)
        self.exponents = [0] * len(self.params)
        self.limit = math.inf
        self.padding = False
        self.overflow = 0
        self.nonfinite = 0
        self.observed = [0.0] * len(self.params)
        self.before_collective: Callable[[], None] = lambda: None  # fault injection point (p3)

    def begin_step(self, scale: FixedPointScale | None) -> None:
        self.acc.zero_()
        self.overflow = self.nonfinite = 0
        self.observed = [0.0] * len(self.params)
        for p in self.params:
            p.grad = None
        if scale is not None:
            self.exponents, self.limit = scale.exponents(), scale.limit

    def quantise(self, index: int, values: torch.Tensor) -> torch.Tensor:
        """Exact mode: ``values`` (one microbatch's gradient of tensor ``index``) in int64 fixed point. Same
        rule and same integers as ``GradientReducer._fold_one`` (elementwise, so the layout does not matter)."""
        peak = float(values.abs().max()) if values.numel() else 0.0
        if not math.isfinite(peak):
            self.nonfinite += 1
            return torch.zeros(values.shape, dtype=torch.int64)
        self.observed[index] = max(self.observed[index], peak)
        scale = 2.0 ** self.exponents[index]
        if peak * scale >= self.limit:
            self.overflow += 1
            return torch.zeros(values.shape, dtype=torch.int64)
        return values.mul(scale).round_().long()

    @torch.no_grad()
    def after_backward(self) -> None:
        """``k == 1`` exact mode: fold the microbatch's whole-tensor gradients (FSDP folds them itself)."""
        if self.k == 1 and self.exact:
            for s in self.segments:
                p = self.params[s.index]
                if p.grad is not None and not self.padding:
                    self.acc[s.offset : s.offset + s.padded] += self.quantise(s.index, p.grad.reshape(-1))
                p.grad = None

    def contribution(self) -> torch.Tensor:
        """A fresh buffer with the local contribution (out of place: an interrupted reduction can be redone)."""
        if self.exact:
            return self.acc.clone()
        flat = torch.zeros(self.size, dtype=torch.float32)
        for s in self.segments:
            g = self.params[s.index].grad
            if g is not None:
                flat[s.offset : s.offset + s.numel] = local(g).reshape(-1)
        return flat

    @torch.no_grad()
    def apply(self, reduced: torch.Tensor) -> None:
        """``param.grad`` := the reduced shard (exact: int64 -> float32 rounds once, then the exact 2**-e)."""
        for s in self.segments:
            p = self.params[s.index]
            vals = reduced[s.offset : s.offset + s.numel]
            if self.exact:
                vals = vals.to(torch.float32).mul_(2.0 ** -self.exponents[s.index])
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local(p.grad).copy_(vals.view_as(local(p.grad)))


# -- exact, layout-independent gradient norm --------------------------------------------------------------
def exact_clip_and_track(
    grads: list[torch.Tensor],
    full_numels: list[int],
    reduce_max: Callable[[torch.Tensor], None],
    reduce_sum_int: Callable[[torch.Tensor], None],
    max_norm: float,
    scale: FixedPointScale | None,
) -> float:
    """Clip ``grads`` (local shards) to ``max_norm`` by a global norm that is the same bits however the tensors
    are sharded: squares of float32 values are exact in float64; each tensor's squares are summed as int64 in
    fixed point (a scale from the tensor's global max and numel), which is associative. Then
    ``scale.track`` of the clipped per-tensor maxima (as ``StepProtocol.commit``). Returns the norm."""
    peaks = torch.tensor([float(local(g).abs().max()) if local(g).numel() else 0.0 for g in grads], dtype=torch.float64)
    reduce_max(peaks)
    exps = []
    sums = torch.zeros(len(grads), dtype=torch.int64)
    for i, g in enumerate(grads):
        peak = float(peaks[i])
        if peak == 0.0:
            exps.append(0)
            continue
        top = math.frexp(peak * peak)[1]  # peak^2 < 2**top
        e = 62 - math.ceil(math.log2(max(2, full_numels[i]))) - top
        exps.append(e)
        sq = local(g).double().reshape(-1).square().mul_(2.0**e).round_().long()
        sums[i] = int(sq.sum())
    reduce_sum_int(sums)
    total = 0.0
    for i in range(len(grads)):
        total += float(sums[i]) * 2.0 ** -exps[i]
    norm = math.sqrt(total)
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                local(g).mul_(coef)
    if scale is not None:
        after = torch.tensor(
            [float(local(g).abs().max()) if local(g).numel() else 0.0 for g in grads], dtype=torch.float64
        )
        reduce_max(after)
        scale.track(after.tolist())
    return norm


# -- one rank of a replica under the FT layer -------------------------------------------------------------
class Interrupted(Exception):
    pass


@dataclass
class Config:
    M: int = 8
    steps: int = 3
    exact: bool = True
    clip: float = 1.0
    lr: float = 1e-3
    op_timeout_s: float = 20.0
    pg_timeout_s: float = 20.0
    initial_bound_exp: int | None = None  # exact mode: force an overflow redo at step 0 (tests the grow rule)
    kill: dict[str, int] | None = (
        None  # {replica, shard, step, round[, hang]}: SIGKILL (SIGSTOP) it before a reduce-scatter
    )
    min_step_s: float = 0.0  # pad each step to this (p3: longer than a replacement's start-up on this machine)


class ReplicaRank:
    """One rank (shard ``role.shard``) of replica ``role.replica``.

    Groups: ``self.pg`` (the default process group of this process) is the replica's own k ranks: FSDP's
    all-gathers and reduce-scatters, and the small intra-replica agreements, run on it. ``self.group`` is the
    FT group of this shard index: shard j of every live replica, one per membership epoch, formed by
    ``unbroken.ft.comm.form_group`` under the store prefix ``shard<j>/``; the gradient shard and the side vector
    are reduced on it with unbroken's bounded, interruptible waits."""

    def __init__(self, role: Role, store: TCPStore, port: int, cfg: Config, model_fn: Callable[[], Any] | None = None):
        self.role, self.store, self.port, self.cfg = role, store, port, cfg
        self.M = cfg.M
        self.members = Membership(port, role)
        dist.init_process_group(
            "gloo",
            store=PrefixStore(f"replica{role.replica}.{role.incarnation}", store),
            rank=role.shard,
            world_size=role.k,
            timeout=datetime.timedelta(seconds=cfg.pg_timeout_s),
        )
        self.model = (model_fn or build_model)()
        if role.k > 1:
            self.mesh = init_device_mesh("cpu", (role.k,), mesh_dim_names=("shard",))
            shard_model(self.model, self.mesh)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.1)
        self.scale = FixedPointScale(len(self.params), self.M) if cfg.exact else None
        if self.scale is not None and cfg.initial_bound_exp is not None:
            self.scale.bound_exp = [cfg.initial_bound_exp] * len(self.params)
        self.fold = ShardFold(self.model, role.k, cfg.exact, self.M)
        self.fold.before_collective = self._maybe_kill
        self.round = 0
        self.side = SideVector(self.M)
        self.group: comm.Group | None = None
        self.step = 0 if role.incarnation == 1 else -1  # a replacement is behind everyone: it receives the state
        self.switch_epoch = 0
        self.recovering = False
        self.history: list[dict[str, Any]] = []
        self.events: list[str] = []
        self._begin()

    # -- small helpers -------------------------------------------------------------------------------
    @property
    def replica_members(self) -> list[int]:
        assert self.group is not None
        return [int(m.split(":")[0]) for m in self.group.members]

    def _begin(self) -> None:
        self.done: list[int] = []  # ids this replica computed in this step (every rank of it knows them)
        self.losses: dict[int, float] = {}  # of the ids this rank computed
        self.fold.begin_step(self.scale)

    def leave(self, why: str) -> None:
        """This replica is broken (a replica-mate died): leave now, with unbroken's 'excluded' status. The
        process may hold collectives blocked on the dead peer; only ending it bounds them."""
        log(self.role, f"{why}: leaving (exit {EXIT_EXCLUDED})")
        self.store.set(f"exit/{self.role}", repr(time.time()))
        sys.stdout.flush()
        os._exit(EXIT_EXCLUDED)

    def intra(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """All-reduce inside the replica, bounded: a replica-mate that died makes the replica dead; leave."""
        if self.role.k == 1:
            return
        work = dist.all_reduce(t, op=op, async_op=True)
        status = comm.wait_all([comm.Pending(work)], self.cfg.op_timeout_s, lambda: False)
        if not status:
            self.leave(f"intra-replica collective {status.value}")

    def agree(self, ok: bool) -> bool:
        """Every rank of the replica takes the same decision: True only if it was True on all of them."""
        t = torch.tensor([1.0 if ok else 0.0])
        self.intra(t, dist.ReduceOp.MIN)
        return bool(t.item() == 1.0)

    def interrupted(self) -> bool:
        assert self.group is not None
        m = self.members
        if m.removed_since(self.group.epoch, self.group.members):
            return True
        return self.recovering and m.latest > self.group.epoch

    def _wait(self, pending: list[comm.Pending]) -> None:
        if not comm.wait_all(pending, self.cfg.op_timeout_s, self.interrupted):
            raise Interrupted

    def _maybe_kill(self) -> None:
        """Fault injection: die (SIGKILL) inside FSDP's backward, just before a reduce-scatter, so that the
        replica-mates are blocked in that collective."""
        s = self.cfg.kill
        if (
            s
            and (s["replica"], s["shard"], s["step"], s["round"])
            == (self.role.replica, self.role.shard, self.step, self.round)
            and self.role.incarnation == 1
        ):
            hang = bool(s.get("hang"))
            self.store.set("killed_at", repr(time.time()))
            log(
                self.role,
                f"{'SIGSTOP (hang)' if hang else 'SIGKILL'} at step {self.step} round {self.round}, "
                "inside FSDP's backward",
            )
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGSTOP if hang else signal.SIGKILL)

    # -- the step ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.store.set(f"ready/{self.role.key}/{self.role.shard}", "1")
        todo = self.recover(first=True)
        while self.step < self.cfg.steps:
            if todo is None:
                todo = self.start_step()
            while True:
                self.compute(todo)
                todo = self.reduce_commit()
                if todo is None:
                    break
        return self.result()

    def start_step(self) -> list[int]:
        assert self.group is not None
        if self.switch_epoch > self.group.epoch or self.members.removed_since(self.group.epoch, self.group.members):
            return self.recover()
        return list(plan_ids(self.step, self.replica_members, range(self.M), self.M).ids_for(self.role.replica))

    def compute(self, ids: list[int]) -> None:
        """This replica's ids in rounds of k: in round r rank j computes ids[r*k + j] (or a zero contribution
        when the round is short: it must still take part in FSDP's collectives)."""
        k, j = self.role.k, self.role.shard
        for r in range(math.ceil(len(ids) / k)):
            rnd = ids[r * k : (r + 1) * k]
            self.round = r
            mine = rnd[j] if j < len(rnd) else None
            self.fold.padding = mine is None
            loss = loss_of(self.model, microbatch(self.step, mine if mine is not None else rnd[0]))
            factor = 0.0 if (mine is None and not self.cfg.exact) else 1.0
            try:
                (loss * (factor / self.M)).backward()
            except RuntimeError as e:  # an FSDP collective failed: a replica-mate is gone, so is the replica
                self.leave(f"FSDP collective failed in backward: {str(e).splitlines()[0][:90]}")
            self.fold.after_backward()
            if mine is not None:
                self.losses[mine] = float(loss.detach())
            self.done.extend(rnd)
        self.fold.padding = False

    def side_vector(self) -> torch.Tensor:
        """This replica's side vector: each rank encodes its own microbatches, the replica sums them; the
        per-replica fields (members, epoch, newest epoch) come from rank 0 only."""
        assert self.group is not None
        first = self.role.shard == 0
        leader = first and self.group.rank == 0
        v = self.side.encode(
            worker=self.role.replica,
            losses=self.losses,
            tokens={},
            done=list(self.losses),
            efficient=[],
            nonfinite=[],
            overflow=self.fold.overflow,
            seconds=0.0,
            bad_param=None,
            epoch=self.group.epoch if first else 0,
            newest_epoch=self.members.latest if leader else 0,
        )
        if not first:
            v[self.side.fields["members"]] = 0
        return v

    def reduce_commit(self) -> list[int] | None:
        """Reduce the shard across replicas; None once the step is committed, else the ids to compute next."""
        side = self.side_vector()
        self.intra(side)
        ok = True
        try:
            contrib = self.fold.contribution()
            self._wait([comm.allreduce_async(self.group, contrib), comm.allreduce_async(self.group, side)])
        except Interrupted:
            ok = False
        if not self.agree(ok):  # replica-level atomicity: commit only if every shard's reduction completed
            self.events.append(f"step {self.step}: reduction interrupted at epoch {self.group.epoch}")
            return self.recover()
        red = self.side.decode(side)
        counted = red.counted
        assert red.members == self.group.size, (red.members, self.group.size)
        assert red.epoch_sum == self.group.epoch * self.group.size
        if red.overflow > 0:  # exact mode: grow the bounds from the MAX over every microbatch, redo the step
            observed = torch.tensor(self.fold.observed, dtype=torch.float64)
            self.intra(observed, dist.ReduceOp.MAX)
            try:
                self._wait([comm.allreduce_async(self.group, observed, max_op=True)])
            except Interrupted:
                return self.recover()
            self.scale.grow(observed.tolist())
            self.events.append(f"step {self.step}: fixed-point overflow, bounds grown, step redone")
            self._begin()
            return list(plan_ids(self.step, self.replica_members, range(self.M), self.M).ids_for(self.role.replica))
        assert all(c == 1 for c in counted), f"step {self.step}: counts {counted}"
        self.fold.apply(contrib)
        loss = sum(red.loss) / self.M
        if self.cfg.exact:
            norm = exact_clip_and_track(
                [p.grad for p in self.params],
                [p.numel() for p in self.params],
                lambda t: self.intra(t, dist.ReduceOp.MAX),
                lambda t: self.intra(t),
                self.cfg.clip,
                self.scale,
            )
        else:  # fp32: torch's clip (on DTensors its norm is a collective inside the replica)
            total = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip, foreach=True)
            norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
        self.opt.step()
        self.history.append(
            {
                "step": self.step,
                "loss": loss,
                "norm": norm,
                "epoch": self.group.epoch,
                "replicas": self.replica_members,
                "time": time.time(),
                "cpu": cpu_seconds(),
            }
        )
        if self.cfg.min_step_s > 0:
            time.sleep(max(0.0, self.cfg.min_step_s - (time.time() - getattr(self, "_t_step", 0.0))))
        self._t_step = time.time()
        self.switch_epoch = red.newest_epoch
        self.step += 1
        self.store.set(f"committed/{self.role.key}/{self.role.shard}", str(self.step))
        self._begin()
        return None

    # -- recovery ------------------------------------------------------------------------------------
    def agree_epoch(self, after: int) -> int:
        """Rank 0 of the replica picks the epoch to form (the newest that includes the replica); all use it."""
        e = torch.tensor([float(self.members.wait_for(after)) if self.role.shard == 0 else 0.0])
        self.intra(e, dist.ReduceOp.MAX)
        return int(e.item())

    def recover(self, first: bool = False) -> list[int]:
        """Form the next epoch's shard group, agree on the step (who is behind receives its shard of the state
        from the same shard index of a replica that is ahead), find the ids no live replica holds, plan them.
        Every phase ends with an intra-replica agreement, so a replica never ends half in one epoch."""
        self.recovering = True
        after = self.group.epoch if self.group is not None else 0
        try:
            while True:
                epoch = self.agree_epoch(after)
                after = epoch
                t0 = time.monotonic()
                store = TCPStore("127.0.0.1", self.port, is_master=False)  # its own: a rendezvous may be abandoned
                group, status = comm.form_group(
                    PrefixStore(f"shard{self.role.shard}", store),
                    epoch,
                    self.members.members_of(epoch),
                    self.role.key,
                    "gloo",
                    self.cfg.op_timeout_s,
                    torch.device("cpu"),
                    lambda e=epoch: self.members.latest > e,
                )
                staged, held, ok = None, None, group is not None
                if ok:
                    comm.retire_group(self.group, self.cfg.op_timeout_s + 1.0)
                    self.group = group
                    self.members.joined = True
                    try:
                        staged = self.sync_state()
                        held = torch.zeros(self.M, dtype=torch.float64)
                        if staged is None:  # each shard group holds one rank per replica: once per replica
                            held[self.done] = 1.0
                        self._wait([comm.allreduce_async(self.group, held)])
                    except Interrupted:
                        ok = False
                if not self.agree(ok):
                    continue
                if staged is not None:
                    self.restore(staged)
                    self._begin()
                counts = held.tolist()
                assert all(c in (0.0, 1.0) for c in counts), counts
                missing = [j for j, c in enumerate(counts) if c == 0]
                self.events.append(
                    f"step {self.step}: formed epoch {epoch} (replicas {self.replica_members}) in "
                    f"{time.monotonic() - t0:.3f} s; {'received state; ' if staged is not None else ''}"
                    f"missing ids {missing}"
                )
                return list(plan_ids(self.step, self.replica_members, missing, self.M).ids_for(self.role.replica))
        finally:
            self.recovering = False

    def local_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard of the training state: a float64 header (step, has optimizer state, bounds) and the
        float32 local tensors (parameter shard, then AdamW's step, exp_avg, exp_avg_sq shards per parameter)."""
        has_opt = all(p in self.opt.state for p in self.params)
        parts = []
        for p in self.params:
            parts.append(local(p).detach().reshape(-1))
            if has_opt:
                st = self.opt.state[p]
                parts += [
                    st["step"].reshape(-1).float(),
                    local(st["exp_avg"]).reshape(-1),
                    local(st["exp_avg_sq"]).reshape(-1),
                ]
        bounds = self.scale.bound_exp if self.scale is not None else []
        header = torch.tensor([float(self.step), float(has_opt), *map(float, bounds)], dtype=torch.float64)
        return header, torch.cat(parts)

    def sync_state(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """On a new shard group: agree on the step; a rank that is behind receives its shard of the state from
        the lowest-ranked member that is ahead (a broadcast in this shard's group: no full gather). Returns the
        staged state (applied only once the whole replica received it) or None if not behind."""
        g = self.group
        steps = torch.zeros(g.size, dtype=torch.float64)
        steps[g.rank] = self.step
        self._wait([comm.allreduce_async(g, steps)])
        ahead = float(steps.max())
        if float(steps.min()) == ahead:
            return None
        src = int((steps == ahead).nonzero()[0])
        header, data = self.local_state()
        meta = torch.tensor([float(header.numel()), float(data.numel())], dtype=torch.float64)
        self._wait([comm.broadcast_async(g, meta, src)])
        if g.rank != src:
            header = torch.zeros(int(meta[0]), dtype=torch.float64)
            data = torch.zeros(int(meta[1]), dtype=torch.float32)
        self._wait([comm.broadcast_async(g, header, src)])
        self._wait([comm.broadcast_async(g, data, src)])
        return (header, data) if self.step < ahead else None

    @torch.no_grad()
    def restore(self, staged: tuple[torch.Tensor, torch.Tensor]) -> None:
        header, data = staged
        self.step = int(header[0])
        has_opt = bool(header[1])
        if self.scale is not None:
            self.scale.bound_exp = [int(b) for b in header[2:].tolist()]
        off = 0

        def take(like: torch.Tensor) -> torch.Tensor:
            nonlocal off
            n = local(like).numel()
            out = data[off : off + n].view_as(local(like)).clone()
            off += n
            return out

        for p in self.params:
            local(p).copy_(take(p))
            if has_opt:
                step = data[off : off + 1].clone().reshape(())
                off += 1
                avg, sq = take(p), take(p)
                if isinstance(p, DTensor):
                    avg = DTensor.from_local(avg, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                    sq = DTensor.from_local(sq, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                self.opt.state[p] = {"step": step, "exp_avg": avg, "exp_avg_sq": sq}
        assert off == data.numel()

    def result(self) -> dict[str, Any]:
        return {
            "role": str(self.role),
            "replica": self.role.replica,
            "shard": self.role.shard,
            "checksum": full_checksum(self.model),
            "local_checksum": local_checksum(self.params),
            "history": self.history,
            "events": self.events,
            "peak_rss_mb": peak_rss_mb(),
        }


def replica_worker(role: Role, store: TCPStore, port: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A rank of the HSDP-under-FT prototype (used by p2 and p3)."""
    rank = ReplicaRank(role, store, port, Config(**cfg))
    return rank.run()


# -- the unsharded reference: unbroken's own GradientReducer (exact mode), one process, no FSDP -------------
def reference_worker(role: Role, store: TCPStore, port: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The same training with unbroken's ``GradientReducer(exact=True)`` on the unsharded model (a group of one)."""
    c = Config(**cfg)
    model = build_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.1)
    history = []
    if c.exact:
        scale = FixedPointScale(len(params), c.M)
        if c.initial_bound_exp is not None:
            scale.bound_exp = [c.initial_bound_exp] * len(params)
        reducer = comm.GradientReducer(params, bucket_bytes=1 << 20, num_extras=1, exact=True)
        group = comm.Group(1, (0,), 0, None, torch.device("cpu"))
    step = 0
    while step < c.steps:
        if c.exact:
            reducer.reset_local()
            reducer.set_exponents(scale.exponents(), scale.limit)
        else:
            for p in params:
                p.grad = None
        losses = []
        for mb in range(c.M):
            loss = loss_of(model, microbatch(step, mb))
            (loss / c.M).backward()
            losses.append(float(loss.detach()))
            if c.exact:
                reducer.fold(mb)
        if c.exact:
            if reducer.flags.overflow:
                scale.grow(reducer.observed)
                continue  # redo the step with the grown bounds
            reducer.launch_gradients(group)
            reducer.launch_extras(torch.zeros(1, dtype=torch.float64))
            status, _ = reducer.wait(10.0, lambda: False)
            assert status
            reducer.apply()
            norm = exact_clip_and_track(
                [p.grad for p in params], [p.numel() for p in params], lambda t: None, lambda t: None, c.clip, scale
            )
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(params, c.clip))
        opt.step()
        history.append({"step": step, "loss": sum(losses) / c.M, "norm": norm})
        step += 1
    return {
        "role": "reference 1x1 (GradientReducer)",
        "checksum": full_checksum(model),
        "history": history,
        "replica": 0,
        "shard": 0,
        "param_sha": named_checksums(model),
    }
