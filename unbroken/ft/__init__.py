"""unbroken.ft: fault tolerance inside your own training loop (docs/library.md).

    import unbroken.ft as ft

    ctx = ft.init()
    ctx.register_state(model=model, optimizer=optimizer)
    for step in ctx.steps():
        for mb in step.microbatches():
            step.backward(loss_fn(model(*batch_for(step.index, mb))))
        step.commit(optimizer)

The subpackage also holds the pieces it is built from: fault-tolerant collectives (``comm``), the step
protocol (``protocol``), the side vector (``sidevec``), the exact reduction's scale (``exact``), the training
state and its checkpoints (``state``, ``checkpoint``), fault injection (``inject``), process life
(``process``) and MeCeFO's efficient backward (``efficient``).
"""

from unbroken.ft.api import Context, Step, StepOutcome, init
from unbroken.ft.efficient import EfficientBackward, EfficientConfig, apply_efficient_backward

__all__ = [
    "Context",
    "EfficientBackward",
    "EfficientConfig",
    "Step",
    "StepOutcome",
    "apply_efficient_backward",
    "init",
]
