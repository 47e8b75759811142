"""MeCeFO's efficient mode: the cheap backward a neighbour uses for the microbatches it covers.

Owns ``apply_efficient_backward(model, cfg)``, a training-time transform applied from outside the model
(``model.py`` stays the reference), and the ``EfficientBackward`` handle it returns: the per-microbatch
on/off switch and the low-rank projection bases. It knows the LLaMA block structure and nothing about
training loops, process groups or failures; the trainer decides which microbatches run efficiently and
how the attention gradients (absent for those microbatches) are averaged.

With the mode on, a forward pass computes exactly the same values as the model's own forward, but its
backward applies the three techniques of MeCeFO (paper sections 3.2-3.4, docs: reference/mecefo.md 2.3-2.5):

1. Skip-connection. Every attention sub-block (pre-attention norm and attention) runs under
   ``torch.no_grad()``: nothing is kept for its backward, the gradient reaches the block input through
   the residual alone, and no attention parameter (nor the pre-attention norm weight) gets a gradient
   from that microbatch: their ``.grad`` is left as it was (``None`` when nothing else wrote it).
2. FFN recomputation. Per block, only the FFN sub-block's input ``h`` (the input of the pre-FFN norm,
   i.e. the residual stream after attention) is kept. The backward recomputes the norm, ``gate(x)``,
   ``up(x)`` and the activation from it, under the autocast state the forward ran in; the input gradient
   (to ``h``) and the norm weight gradient are exact. Keeping ``h`` rather than the norm output saves the
   norm's own saved tensors too, so a block keeps one (tokens x dim) tensor in all.
3. Low-rank FFN weight gradient. For each FFN linear ``y = x W^T`` (gate, up, down), the weight gradient
   ``G_y^T x`` is replaced by ``G_y^T (x V) V^T``, where V (in_features x r) holds (an estimate of) the
   top-r right singular vectors of W. A matrix with ``rank >= in_features`` gets its exact weight
   gradient (no projection).

With the mode off, every patched module calls its original bound ``forward``, so exact microbatches are
bit-identical to the untransformed model.

Blocks are found by attribute names, so models we did not write work too: ``LAYOUTS`` lists our own
(meta-llama / torchtitan names: ``attention``, ``attention_norm``, ``feed_forward`` with ``w1`` gate,
``w3`` up, ``w2`` down, SiLU) and Hugging Face LLaMA-family decoder layers (``self_attn``,
``input_layernorm``, ``mlp`` with ``gate_proj``/``up_proj``/``down_proj``/``act_fn``,
``post_attention_layernorm``). The transform patches the four sub-modules' ``forward``, never the
block's, so whatever the block's signature and return type, it works as long as the block computes
``h = x + attention(attention_norm(x)); out = h + mlp(ffn_norm(h))``. A block whose MLP input is not
its ``ffn_norm`` output (e.g. Gemma-2's extra norms) is detected at the first efficient forward and
raises ``RuntimeError``. Activation checkpointing of the blocks (``transforms.py``) works on top: its
recomputation reads the switch again, so the switch must not change between a forward and its backward (a
change is caught by checkpoint's determinism check). Under ``torch.compile`` the efficient forwards are
excluded from tracing (``torch.compiler.disable``) and run eagerly; the exact path is compiled. Hugging Face's
own gradient checkpointing is refused.

The bases. V is computed by a randomized range finder with ``power_iters`` subspace iterations and
``oversample`` extra columns (Halko, Martinsson and Tropp 2011, algorithms 4.4 and 5.1), in float32 on
the weights' device, with the Gaussian test matrix drawn from a ``torch.Generator`` seeded from (bases
step, block, matrix): the bases are a pure function of the weights and the step they were taken at, so
every worker of one device type and torch build (and, on CPU, one intra-op thread count) computes
bit-identical V from identical weights. docs/gpu.md ("MeCeFO bases") has the error against the full SVD
and the times. When they are computed: the bases of the tau-window ``[k tau, (k+1) tau)``
(tau = ``refresh_every``, the paper's 100) come from the weights at the window's first step at which
``refresh(step, needed=True)`` is called, i.e. the first step with an efficient microbatch on any member,
so a failure-free window computes nothing. ``refresh`` starts the computation on a background thread (on
a CUDA side stream for CUDA weights), last block first, and returns: the bases are used in the backward
only, so the first efficient microbatch's forward overlaps it and its backward waits, block by block, only
for what is not done yet; ``wait()``, ``bases()`` and any ``torch.optim`` optimizer step join all of it (the
weights must not change before it has read them). The intra-op thread count is left alone. The bases live
in the handle, not in the model (no parameters or buffers), so the model's state dict and parameter
checksums are unaffected; ``bases()`` / ``load_bases(bases, step)`` let a trainer checkpoint or send them,
with ``bases_step``, to a rejoining worker. The defaults (``DEFAULT_OVERSAMPLE`` 16, ``DEFAULT_POWER_ITERS``
2) add at most 0.0022 to the FFN weight-gradient projection error of the exact top-r subspace for r = 8 to
128 (docs/gpu.md).

``DEFAULT_RANK`` (64) was chosen from the gradient-error measurements in docs/benchmarks.md ("MeCeFO"):
the FFN weight-gradient error falls slowly with r, and 64 reaches the paper's error level for about half
of the exact weight-gradient cost.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = [
    "DEFAULT_RANK",
    "LAYOUTS",
    "BlockLayout",
    "EfficientBackward",
    "EfficientConfig",
    "apply_efficient_backward",
    "basis_seed",
    "randomized_basis",
]

DEFAULT_RANK = 64
DEFAULT_OVERSAMPLE = 16
DEFAULT_POWER_ITERS = 2


@dataclass(frozen=True)
class EfficientConfig:
    """The transform's settings (a run's ``[mecefo]`` section).

    ``rank`` is r of the FFN weight-gradient projection and ``refresh_every`` the period tau (steps) of its
    bases; ``oversample`` and ``power_iters`` tune the randomized SVD that computes them (docs/gpu.md,
    "MeCeFO bases", has the error each choice gives).
    """

    rank: int = DEFAULT_RANK
    refresh_every: int = 100
    oversample: int = DEFAULT_OVERSAMPLE
    power_iters: int = DEFAULT_POWER_ITERS

    def __post_init__(self) -> None:
        if self.rank < 1 or self.refresh_every < 1:
            raise ValueError(
                f"efficient mode needs rank >= 1 and refresh_every >= 1 (got {self.rank}, {self.refresh_every})"
            )
        if self.oversample < 0 or self.power_iters < 0:
            raise ValueError(
                f"efficient mode needs oversample >= 0 and power_iters >= 0 (got {self.oversample}, {self.power_iters})"
            )


@dataclass(frozen=True)
class BlockLayout:
    """Attribute names of one LLaMA-family block and of its SwiGLU MLP."""

    attention: str
    attention_norm: str
    mlp: str
    ffn_norm: str
    gate: str
    up: str
    down: str
    act: str | None  # the MLP's activation attribute; None: SiLU, applied by the MLP's own forward


LAYOUTS: tuple[BlockLayout, ...] = (
    BlockLayout("attention", "attention_norm", "feed_forward", "ffn_norm", "w1", "w3", "w2", None),  # ours
    BlockLayout(  # Hugging Face LlamaDecoderLayer (also Mistral, Qwen2 and the like)
        "self_attn", "input_layernorm", "mlp", "post_attention_layernorm", "gate_proj", "up_proj", "down_proj", "act_fn"
    ),
)


@dataclass(eq=False)
class _Block:
    index: int
    name: str
    attention: nn.Module
    attention_norm: nn.Module
    mlp: nn.Module
    ffn_norm: nn.Module
    linears: tuple[nn.Linear, nn.Linear, nn.Linear]  # gate, up, down
    act: Callable[[torch.Tensor], torch.Tensor]
    weight_names: tuple[str, str, str]
    originals: dict[str, Callable[..., Any]] = field(default_factory=dict)  # sub-module name -> bound forward
    pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (ffn_norm input, its output) until the MLP runs


Bases = list[tuple[torch.Tensor | None, ...]]  # per block: (gate, up, down), None where the gradient is exact


@dataclass(eq=False)
class _Refresh:
    """One basis computation in flight on a background thread, block by block from the last (the first one
    a backward reaches): block i's bases are usable once ``ready[i]`` is set (and, for CUDA weights, once the
    stream that uses them has waited for ``events[i]``)."""

    step: int
    device: torch.device  # the weights'
    versions: list[int]  # the weights' version counters when it started: they must not move until it is joined
    bases: list[tuple[torch.Tensor | None, ...] | None]
    ready: list[threading.Event]
    events: list[torch.cuda.Event | None]  # recorded on the side stream after block i's last kernel
    thread: threading.Thread | None = None
    error: BaseException | None = None

    def block(self, index: int) -> tuple[torch.Tensor | None, ...]:
        """Block ``index``'s bases, once computed (re-raises the computation's error)."""
        self.ready[index].wait()
        if self.error is not None:
            raise self.error
        bases, event = self.bases[index], self.events[index]
        assert bases is not None
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for v in bases:
                if v is not None:
                    v.record_stream(stream)  # allocated on the side stream, used on this one
        return bases


class EfficientBackward:
    """The handle ``apply_efficient_backward`` returns: the on/off switch and the projection bases.

    Call order: ``refresh(step, needed)`` once a step's plan is known, on every worker, with the same
    ``needed`` on all of them (whether any worker runs an efficient microbatch in this step); then run each
    efficient microbatch's forward inside ``with eb.enabled():``. The mode is read during the forward; the
    backward may run inside or after the context. Before anything writes the weights, the computation
    ``refresh`` may have started must be joined: ``wait()`` does it, and so does every ``torch.optim``
    optimizer's ``step()`` (a global step pre-hook, removed by ``remove()``); write the weights any other
    way (``load_state_dict``, a custom optimizer) only after ``wait()``.

    The bases used for step s are a pure function of the weights at ``bases_step``, the first step of s's
    tau-window at which ``refresh(..., needed=True)`` was called, and of that step number; no bases exist
    before the first such call (``bases()`` is then empty). A worker that joins or resumes gets the
    current ones, with their step, through ``load_bases(bases, step)``.
    """

    def __init__(self, blocks: list[_Block], config: EfficientConfig) -> None:
        self.config = config
        self._blocks = blocks
        self._on = False
        self._step = 0  # the step of the last refresh() call: what an efficient forward without bases keys to
        self._bases: Bases = []
        self._bases_step: int | None = None  # the step of the bases held; None: no bases
        self._pending: _Refresh | None = None
        self._stream: torch.cuda.Stream | None = None
        ref = weakref.ref(self)

        def join_before_step(*_: Any) -> None:
            handle = ref()
            if handle is not None:
                handle.wait()

        self._hook = register_optimizer_step_pre_hook(join_before_step)
        weakref.finalize(self, self._hook.remove)

    @property
    def bases_step(self) -> int | None:
        """The step whose weights the bases come from (those in flight, if a computation is); None: none yet."""
        return self._pending.step if self._pending is not None else self._bases_step

    @property
    def active(self) -> bool:
        """Whether forwards run now are efficient."""
        return self._on

    def set_active(self, on: bool) -> None:
        """Switch efficient mode on or off for the forwards that follow (``enabled()`` as a context)."""
        self._on = on

    @contextlib.contextmanager
    def enabled(self, on: bool = True) -> Iterator[None]:
        """Run forwards inside the context in efficient mode (``on=False``: exact; for one code path)."""
        previous, self._on = self._on, on
        try:
            yield
        finally:
            self._on = previous

    def refresh(self, step: int, needed: bool = True) -> bool:
        """Start computing the bases from the current weights if ``needed`` and those held (or in flight) are
        not from ``step``'s tau-window; returns whether it started.

        ``needed``: some worker runs an efficient microbatch in ``step`` (the same on every worker, so that
        all hold the same bases). Call it between steps or once the step's plan is known (again after an
        in-step re-plan: a repeated call is free), not between a forward and its backward. The computation
        runs on a background thread, last block first; an efficient microbatch's backward waits for each
        block's bases when it reaches the block, ``wait()`` (and an optimizer step) for all of them.
        """
        self._step = step
        if not needed or self._current(step):
            return False
        self.wait()
        self._start(step)
        return True

    def wait(self) -> None:
        """Join the computation ``refresh`` started, if any, and take its bases (re-raising its error).

        On CUDA the current stream is made to wait for its kernels, so the weights may be written after.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        assert pending.thread is not None
        pending.thread.join()
        bases = [pending.block(i) for i in range(len(self._blocks))]
        if [w._version for w in self._weights()] != pending.versions:
            raise RuntimeError(
                f"the FFN weights changed while the MeCeFO bases of step {pending.step} were computed from them: "
                "call EfficientBackward.wait() before writing the weights"
            )
        self._bases = bases
        self._bases_step = pending.step

    def bases(self) -> list[torch.Tensor]:
        """The V tensors (in_features x min(r, out_features)): block by block, gate, up, down; exact-gradient
        matrices skipped; empty before the first computation.

        The same count and shapes for every handle built from the same model shape and config once it has
        bases, for checkpoints and state transfers (with ``bases_step``); copying into them in place updates
        the handle.
        """
        self.wait()
        return [v for vs in self._bases for v in vs if v is not None]

    def named_bases(self) -> dict[str, torch.Tensor]:
        """``bases()`` keyed by the name of the FFN weight each one projects."""
        self.wait()
        return {
            name: v
            for block, vs in zip(self._blocks, self._bases, strict=True)
            for name, v in zip(block.weight_names, vs, strict=True)
            if v is not None
        }

    def _projected(self) -> Iterator[tuple[str, nn.Linear, tuple[int, int]]]:
        """(weight name, linear, basis shape) of every FFN weight with a basis, in ``bases()``'s order."""
        for b in self._blocks:
            for name, linear in zip(b.weight_names, b.linears, strict=True):
                if (shape := _basis_shape(linear.weight, self.config.rank)) is not None:
                    yield name, linear, shape

    def empty_named_bases(self) -> dict[str, torch.Tensor]:
        """``named_bases()``'s names and shapes, uninitialised, on the weights' devices: what a sharded
        checkpoint's bases are read into (``load_named_bases``)."""
        return {
            name: torch.empty(shape, dtype=linear.weight.dtype, device=linear.weight.device)
            for name, linear, shape in self._projected()
        }

    def load_named_bases(self, bases: dict[str, torch.Tensor], step: int | None = None) -> None:
        """``load_bases`` from bases keyed by weight name (``named_bases()``: a sharded checkpoint's, where each
        pipeline stage saved its own blocks').

        Raises:
            ValueError: a basis of this handle's is missing, or the shapes do not match.
        """
        names = [name for name, _, _ in self._projected()]
        missing = [n for n in names if n not in bases]
        if bases and missing:
            raise ValueError(f"MeCeFO bases do not match: none for {missing[0]} (another model or rank?)")
        self.load_bases([bases[n] for n in names] if bases else [], step)

    def settle(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, for a computation of bases in flight: a thread still inside torch's
        kernels when the interpreter finalizes can abort the process (call before it exits)."""
        pending = self._pending
        if pending is not None and pending.thread is not None:
            pending.thread.join(timeout_s)

    def load_bases(self, bases: list[torch.Tensor], step: int | None = None) -> None:
        """Replace the bases with copies of ``bases`` (as returned by ``bases()``, e.g. from a checkpoint or a
        live worker) taken from the weights of ``step`` (their ``bases_step``). A computation in flight is
        dropped. Empty ``bases`` or ``step=None`` (a state saved without it): no bases, the next needed
        ``refresh`` computes them.

        Raises:
            ValueError: their count or shapes do not match this handle's (another model shape or rank).
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending.thread is not None:
            pending.thread.join()  # superseded: its result (and any error) is dropped
        if not bases or step is None:
            self._bases, self._bases_step = [], None
            return
        shapes = [[_basis_shape(linear.weight, self.config.rank) for linear in b.linears] for b in self._blocks]
        own = [shape for row in shapes for shape in row if shape is not None]
        if [tuple(t.shape) for t in bases] != own:
            raise ValueError(
                f"MeCeFO bases do not match: got {len(bases)} of shapes {sorted({tuple(t.shape) for t in bases})}, "
                f"expected {len(own)} of shapes {sorted(set(own))} (another model or rank?)"
            )
        loaded = iter(bases)
        self._bases = [
            tuple(
                None if shape is None else next(loaded).detach().to(linear.weight.device, linear.weight.dtype).clone()
                for shape, linear in zip(row, b.linears, strict=True)
            )
            for row, b in zip(shapes, self._blocks, strict=True)
        ]
        self._bases_step = step

    def _current(self, step: int) -> bool:
        """Whether the bases held or in flight come from ``step``'s tau-window (and not from a later step)."""
        tau = self.config.refresh_every
        at = self.bases_step
        return at is not None and at <= step and at // tau == step // tau

    def _weights(self) -> list[torch.Tensor]:
        """The FFN weights as this process holds them (an FSDP rank: its shards)."""
        return [_local(linear.weight) for b in self._blocks for linear in b.linears]

    def _full_weights(self) -> list[list[torch.Tensor]]:
        """Per block, its (gate, up, down) weights whole. Weights sharded by FSDP are gathered here, on the
        calling thread (every rank of the replica calls ``refresh`` at the same point of the step protocol, and
        a collective must not run on the background thread beside FSDP's own), once per tau-window."""
        return [[_full(linear.weight) for linear in b.linears] for b in self._blocks]

    def _start(self, step: int) -> None:
        weights = self._weights()
        full = self._full_weights()
        num_blocks = len(self._blocks)
        device = weights[0].device
        pending = _Refresh(
            step,
            device,
            [w._version for w in weights],
            bases=[None] * num_blocks,
            ready=[threading.Event() for _ in range(num_blocks)],
            events=[None] * num_blocks,
        )
        stream = None
        if device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(device))  # the last optimizer step's writes
            pending.events = [torch.cuda.Event() for _ in range(num_blocks)]
        config, blocks = self.config, self._blocks
        threads = torch.get_num_threads()

        def run() -> None:
            # A new thread's first LAPACK calls (the QR and SVD below) run with OpenMP's default thread count
            # (the host's cores), not the process's, until some ATen op has set the thread up: the first basis
            # would then have other bits than the rest, and depend on the host and on which block comes first.
            torch.set_num_threads(threads)
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for b in reversed(blocks):
                        pending.bases[b.index] = tuple(
                            randomized_basis(
                                weight,
                                config.rank,
                                config.oversample,
                                config.power_iters,
                                basis_seed(step, b.name, k),
                            )
                            for k, weight in enumerate(full[b.index])
                        )
                        event = pending.events[b.index]
                        if event is not None:
                            event.record(stream)
                        pending.ready[b.index].set()
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
                pending.error = e
            finally:
                for ready in pending.ready:
                    ready.set()

        pending.thread = threading.Thread(target=run, name=f"mecefo-bases-{step}", daemon=True)
        self._pending = pending
        pending.thread.start()

    def _bases_of(self, index: int) -> Callable[[], tuple[torch.Tensor | None, ...]]:
        """For an efficient forward of block ``index``: what its backward calls to get the block's bases. A
        computation in flight is joined there, for that block only, so it overlaps the forward; with no bases
        for the last ``refresh`` step's window (a caller that never said ``needed``), one starts now."""
        if not self._current(self._step):
            self.refresh(self._step, needed=True)
        pending = self._pending
        if pending is None:
            held = self._bases[index]
            return lambda: held
        return lambda: pending.block(index)

    def attention_parameters(self) -> list[nn.Parameter]:
        """The parameters an efficient microbatch gives no gradient to: attention and pre-attention norm."""
        return [p for b in self._blocks for m in (b.attention_norm, b.attention) for p in m.parameters()]

    def remove(self) -> None:
        """Restore the original forwards and remove the optimizer hook; the handle is unusable afterwards."""
        self.wait()
        self._hook.remove()
        for block in self._blocks:
            for attr in block.originals:
                del getattr(block, attr).__dict__["forward"]
            block.originals.clear()
        self._blocks = []

    # -- the patched forwards -----------------------------------------------------------------------------

    def _patch(
        self, block: _Block, attr: str, make_efficient: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        module = getattr(block, attr)
        original = module.forward  # the bound method; calling it is exactly the unpatched module
        block.originals[attr] = original
        # Under torch.compile the exact path (switch off) is traced; the efficient one runs eagerly: its backward
        # joins the basis computation of a background thread, which cannot be traced.
        efficient = torch.compiler.disable(make_efficient(original))

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._on:
                return efficient(*args, **kwargs)
            return original(*args, **kwargs)

        module.forward = forward

    def _install(self) -> None:
        for block in self._blocks:
            self._patch(block, "attention_norm", _no_grad)
            self._patch(block, "attention", _no_grad)
            self._patch(block, "ffn_norm", lambda original, b=block: _ffn_norm_forward(b, original))
            self._patch(block, "mlp", lambda original, b=block: self._mlp_forward(b, original))

    def _mlp_forward(self, block: _Block, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            pending, block.pending = block.pending, None
            if pending is None or pending[1] is not x:
                raise RuntimeError(
                    f"block {block.name!r}: the MLP input is not the output of its pre-FFN norm, so the block "
                    "is not a pre-norm LLaMA block and efficient mode cannot be applied to it"
                )
            gate, up, down = block.linears
            return _EfficientFFN.apply(
                pending[0],
                x,
                block,
                original,
                self._bases_of(block.index),
                gate.weight,
                up.weight,
                down.weight,
                gate.bias,
                up.bias,
                down.bias,
                *block.ffn_norm.parameters(),
            )

        return forward


def apply_efficient_backward(model: nn.Module, config: EfficientConfig | None = None) -> EfficientBackward:
    """Patch every LLaMA-family block of ``model`` for MeCeFO's efficient mode (off until ``enabled()``).

    Adds no parameters or buffers and computes nothing yet: the bases are computed when first needed (see
    ``EfficientBackward`` for the call order).

    Raises:
        ValueError: no block matches ``LAYOUTS``, the model was already transformed, or it uses
            Hugging Face gradient checkpointing (checked here only: do not enable it afterwards).
    """
    config = config or EfficientConfig()
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ValueError("efficient mode does not support gradient checkpointing of the blocks; disable it")
    names = {id(p): n for n, p in model.named_parameters()}
    matches = ((name, module, _layout(module)) for name, module in model.named_modules())
    blocks = [_block(i, name, m, layout, names) for i, (name, m, layout) in enumerate(x for x in matches if x[2])]
    if not blocks:
        raise ValueError(
            f"no LLaMA-family block found in {type(model).__name__}: a block needs the sub-modules of one of "
            + "; ".join(f"({', '.join(_required(layout))})" for layout in LAYOUTS)
        )
    for block in blocks:
        for m in (block.attention, block.attention_norm, block.mlp, block.ffn_norm):
            if "forward" in m.__dict__:
                raise ValueError(f"block {block.name!r} already has a patched forward (transformed twice?)")
    handle = EfficientBackward(blocks, config)
    handle._install()
    return handle


def _required(layout: BlockLayout) -> list[str]:
    return [layout.attention, layout.attention_norm, layout.mlp, layout.ffn_norm] + [
        f"{layout.mlp}.{n}" for n in (layout.gate, layout.up, layout.down)
    ]


def _layout(module: nn.Module) -> BlockLayout | None:
    for layout in LAYOUTS:
        subs = [
            getattr(module, a, None) for a in (layout.attention, layout.attention_norm, layout.mlp, layout.ffn_norm)
        ]
        if all(isinstance(s, nn.Module) for s in subs) and all(
            isinstance(getattr(subs[2], a, None), nn.Linear) for a in (layout.gate, layout.up, layout.down)
        ):
            return layout
    return None


def _block(index: int, name: str, module: nn.Module, layout: BlockLayout, names: dict[int, str]) -> _Block:
    mlp = getattr(module, layout.mlp)
    linears = tuple(getattr(mlp, a) for a in (layout.gate, layout.up, layout.down))
    return _Block(
        index=index,
        name=name,
        attention=getattr(module, layout.attention),
        attention_norm=getattr(module, layout.attention_norm),
        mlp=mlp,
        ffn_norm=getattr(module, layout.ffn_norm),
        linears=linears,
        act=F.silu if layout.act is None else getattr(mlp, layout.act),
        weight_names=tuple(names[id(linear.weight)] for linear in linears),
    )


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This process's part of ``weight`` (the local part of a ``DTensor``: an FSDP shard, a tensor-parallel slice)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def _full(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` whole (an FSDP ``DTensor`` gathered from the ranks of its replica)."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def _ffn_norm_forward(block: _Block, original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(h: torch.Tensor) -> torch.Tensor:
        # No graph here: the MLP's Function keeps h and recomputes the norm during backward.
        with torch.no_grad():
            out = original(h)
        block.pending = (h, out)
        return out

    return forward


def _no_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return original(*args, **kwargs)

    return forward


def _basis_shape(weight: torch.Tensor, rank: int) -> tuple[int, int] | None:
    """The shape of a weight's basis: (in_features, min(rank, out_features)), None when rank >= in_features."""
    out_features, in_features = weight.shape
    return None if rank >= in_features else (in_features, min(rank, out_features))


def basis_seed(step: int, block: str, matrix: int) -> int:
    """The test-matrix seed of one weight's basis: distinct per (step, block, matrix), equal on every worker.
    The block is named as in the model (``layers.5``), not numbered, so that a block has the same bases
    whichever part of the model a process holds (a pipeline stage keeps the whole model's names)."""
    return (step * 1_000_003 + 3 * zlib.crc32(block.encode()) + matrix) % (1 << 63)


def randomized_basis(
    weight: torch.Tensor, rank: int, oversample: int, power_iters: int, seed: int
) -> torch.Tensor | None:
    """An orthonormal estimate of the top-``rank`` right singular vectors of ``weight`` (out x in), as an
    (in_features x min(rank, out_features)) tensor of the weight's dtype on its device, or None when
    ``rank >= in_features`` (the gradient stays exact).

    Randomized subspace iteration in float32 on the weight's device: Y = (W^T W)^q W^T Omega with Omega an
    (out x (k + oversample)) Gaussian matrix drawn from a generator seeded with ``seed``, re-orthonormalised
    after every product; then the SVD of the small W Q gives the rotation inside span(Q). A pure function
    of (weight, arguments) on one device type and torch build. Cost: (2 + 2 q) products of W with a
    thin matrix, instead of a full SVD's O(in^2 out).
    """
    shape = _basis_shape(weight, rank)
    if shape is None:
        return None
    out_features, in_features = weight.shape
    k = shape[1]
    width = min(k + oversample, out_features, in_features)
    with torch.no_grad():
        w = weight.detach().float()
        gen = torch.Generator(device=w.device).manual_seed(seed)
        omega = torch.randn(out_features, width, generator=gen, device=w.device, dtype=torch.float32)
        q = torch.linalg.qr(w.T @ omega).Q  # (in, width): an orthonormal basis of the sketch of W's row space
        for _ in range(power_iters):
            q = torch.linalg.qr(w.T @ torch.linalg.qr(w @ q).Q).Q
        _, _, vh = torch.linalg.svd(w @ q, full_matrices=False)  # (out, width) -> vh (width, width)
        v = q @ vh[:k].T  # (in, k)
    return v.to(weight.dtype).contiguous()


def _weight_grad(g_out: torch.Tensor, inp: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """(N, out) and (N, in) -> the (out, in) weight gradient, projected onto span(basis) when given."""
    if basis is None:
        return g_out.T @ inp
    return (g_out.T @ (inp @ basis)) @ basis.T


class _EfficientFFN(torch.autograd.Function):
    """``mlp(ffn_norm(h))`` keeping only ``h``; backward recomputes and projects the weight gradients."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        x: torch.Tensor,
        block: _Block,
        mlp_forward: Callable[[torch.Tensor], torch.Tensor],
        bases: Callable[[], tuple[torch.Tensor | None, ...]],
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
        b_gate: torch.Tensor | None,
        b_up: torch.Tensor | None,
        b_down: torch.Tensor | None,
        *norm_params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.block = block
        ctx.bases = bases
        ctx.autocast = _autocast_state(h.device.type)
        ctx.save_for_backward(h, w_gate, w_up, w_down, b_gate, b_up, b_down)
        # x is the norm output computed without a graph; the original forward gives the exact values.
        return mlp_forward(x)

    @staticmethod
    def backward(ctx: Any, g_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, *params = ctx.saved_tensors
        # Tensor-parallel weights (DTensors): this rank computes with its columns of gate and up and its rows of
        # down, and sums what the ranks' shares make of the input's gradient (see ``_tensor_parallel``).
        mesh = getattr(params[0], "device_mesh", None)
        w_gate, w_up, w_down, b_gate, b_up, b_down = (_local(t) if t is not None else None for t in params)
        block: _Block = ctx.block
        v_gate, v_up, v_down = ctx.bases()  # joins the basis computation for this block, if still in flight
        norm_params = list(block.ffn_norm.parameters())
        trained = [p for p in norm_params if p.requires_grad]
        needs = ctx.needs_input_grad
        # Re-enter the forward's autocast state (the backward runs on another thread, or outside the forward's
        # context), so that every op below runs in the precision the same op had, or would have had, in it.
        with torch.autocast(**ctx.autocast):
            with torch.enable_grad():
                h_r = h.detach().requires_grad_()
                x_r = block.originals["ffn_norm"](h_r)  # (B, T, dim)
            x = x_r.detach().reshape(-1, x_r.shape[-1])  # (N, dim)
            g_y = g_y.reshape(-1, g_y.shape[-1])  # (N, dim)
            a = F.linear(x, w_gate, b_gate)  # (N, hidden)
            u = F.linear(x, w_up, b_up)
            with torch.enable_grad():
                a_r = a.requires_grad_()
                s_r = block.act(a_r)
            s = s_r.detach()
            g_p = g_y @ w_down  # (N, hidden)
            (g_a,) = torch.autograd.grad(s_r, a_r, (g_p * u).to(s_r.dtype))
            g_u = g_p * s
            g_x = g_a @ w_gate + g_u @ w_up  # (N, dim)
            if mesh is not None:
                g_x = _sum_over(g_x, mesh)
            g_h, *g_trained = torch.autograd.grad(x_r, [h_r, *trained], g_x.view_as(x_r).to(x_r.dtype))
            g_w_gate = _weight_grad(g_a, x, v_gate).to(w_gate.dtype) if needs[5] else None
            g_w_up = _weight_grad(g_u, x, v_up).to(w_up.dtype) if needs[6] else None
            if not needs[7]:
                g_w_down = None
            elif mesh is not None and v_down is not None:
                # down's basis spans the whole hidden space; this rank holds its rows for its hidden units, and
                # the projection (s u) V sums over all of them.
                v_rows = v_down.chunk(mesh.size(), dim=0)[mesh.get_local_rank()]
                projected = _sum_over((s * u) @ v_rows, mesh)
                g_w_down = ((g_y.T @ projected) @ v_rows.T).to(w_down.dtype)
            else:
                g_w_down = _weight_grad(g_y, s * u, v_down).to(w_down.dtype)
            g_b_gate = g_a.sum(0).to(b_gate.dtype) if b_gate is not None and needs[8] else None
            g_b_up = g_u.sum(0).to(b_up.dtype) if b_up is not None and needs[9] else None
            g_b_down = g_y.sum(0).to(b_down.dtype) if b_down is not None and needs[10] else None
        by_param = dict(zip(map(id, trained), g_trained, strict=True))
        g_norm = [by_param.get(id(p)) for p in norm_params]
        grads = (g_w_gate, g_w_up, g_w_down, g_b_gate, g_b_up, g_b_down)
        return (g_h.to(h.dtype), None, None, None, None, *map(_like, grads, params), *g_norm)


def _sum_over(partial: torch.Tensor, mesh: Any) -> torch.Tensor:
    """The sum of ``partial`` over the ranks of the (1-D) tensor-parallel ``mesh``, in float32 at least."""
    import torch.distributed as dist

    total = partial.float() if partial.dtype in (torch.float16, torch.bfloat16) else partial.clone()
    dist.all_reduce(total, group=mesh.get_group())
    return total.to(partial.dtype)


def _like(grad: torch.Tensor | None, param: torch.Tensor | None) -> torch.Tensor | None:
    """``grad`` (this rank's part) as ``param`` is: a DTensor of its mesh and placements for a tensor-parallel one."""
    if grad is None or param is None or not hasattr(param, "device_mesh"):
        return grad
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(grad, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


def _autocast_state(device_type: str) -> dict[str, Any]:
    """The current autocast settings of ``device_type``, as ``torch.autocast`` keyword arguments."""
    return {
        "device_type": device_type,
        "dtype": torch.get_autocast_dtype(device_type),
        "enabled": torch.is_autocast_enabled(device_type),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }
