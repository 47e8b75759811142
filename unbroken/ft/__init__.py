"""unbroken.ft: fault tolerance inside your own training loop (docs/library.md).

    import unbroken.ft as ft

    ctx = ft.init(overrides=sys.argv[1:])          # python my_train.py --train.steps=100: any config key
    ctx.register_state(model=model, optimizer=optimizer)
    for step in ctx.steps():
        for mb in step.microbatches():
            x, y = batch_for(ctx.generator(step.index, mb))        # data: a pure function of (seed, step, id)
            step.backward(loss_fn(model(x), y), inputs=(x, y))    # inputs: for the data check
        step.commit(optimizer)

The public API is ``__all__``: the loop's calls (``init``, ``Context``, ``Step``, ``StepOutcome``,
``generator``), the run's config and its loader (``RunConfig``, ``load_config``: ``unbroken.core.config``), and
what a loop needs around them:

- a replica of several ranks split on ``ctx.mesh``: ``apply_tensor_parallel(model, mesh["tensor"], plan, ...)``
  and ``check_tensor_parallel``, where ``plan``, a ``TensorParallelPlan``, names the model's projections to split
  (``ft.parallel.tensor``), ``apply_fsdp(model, mesh["shard"])`` (``ft.parallel.fsdp``), imported on first use
  (they cost a worker about a second);
- MeCeFO's efficient backward on a model of your own: ``apply_efficient_backward``, ``EfficientBackward``,
  ``EfficientConfig`` (``ft.mecefo``);
- a run's checkpoints, read outside a job: ``load_latest(run_dir)`` (the newest good one, or None: its
  ``.state["model"]``, ``.step``, ``.sharded``), ``list_checkpoints(run_dir)`` (their steps, newest first, good
  or not) and ``checkpoint_dir(run_dir)`` (``ft.checkpoint.schema``);
- the checks a launcher runs before anything starts: ``check_device(train.device, comm.backend)`` (the device
  type a worker here gets, ValueError if it cannot run) and ``check_compiler()`` (``torch.compile`` on the CPU
  needs a C++ compiler) (``ft.process``, ``ft.transforms``).

The subpackage also holds the pieces it is built from: fault-tolerant collectives (``comm``), the step
protocol (``protocol``, built on one ``stepcontext.StepContext``, and its parts ``membership``, ``stepplan``,
``reduction``, ``update``, ``checkpoint.policy``), the user's step (``step``), evaluation (``evaluation``), how
a worker leaves (``leaving``), the side vector (``sidevec``), the exact reduction's scale (``exact``), the
training state and its checkpoints (``state``, ``checkpoint``), fault injection (``inject``: the step's phase
hook), process life (``process``), MeCeFO's efficient backward (``mecefo``), replicas of several ranks
(``parallel``) and the check that data is pure (``datacheck``).
"""

from typing import Any

from unbroken.core.config import RunConfig, load_config
from unbroken.ft.api import Context, Step, StepOutcome, init
from unbroken.ft.checkpoint.schema import checkpoint_dir, list_checkpoints, load_latest
from unbroken.ft.datacheck import generator
from unbroken.ft.mecefo import EfficientBackward, EfficientConfig, apply_efficient_backward
from unbroken.ft.process import check_device
from unbroken.ft.transforms import check_compiler

# Imported on first use (``__getattr__``): FSDP's and DTensor's modules cost a worker about a second.
_LAZY = {
    "apply_fsdp": "unbroken.ft.parallel.fsdp",
    "apply_tensor_parallel": "unbroken.ft.parallel.tensor",
    "check_tensor_parallel": "unbroken.ft.parallel.tensor",
    "TensorParallelPlan": "unbroken.ft.parallel.tensor",
}

__all__ = [
    "Context",
    "EfficientBackward",
    "EfficientConfig",
    "RunConfig",
    "Step",
    "StepOutcome",
    "TensorParallelPlan",
    "apply_efficient_backward",
    "apply_fsdp",
    "apply_tensor_parallel",
    "check_compiler",
    "check_device",
    "check_tensor_parallel",
    "checkpoint_dir",
    "generator",
    "init",
    "list_checkpoints",
    "load_config",
    "load_latest",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
