"""unbroken.ft: fault tolerance inside your own training loop (docs/library.md).

    import unbroken.ft as ft

    ctx = ft.init(overrides=sys.argv[1:])          # python my_train.py --train.steps=100: any config key
    ctx.register_state(model=model, optimizer=optimizer)
    for step in ctx.steps():
        for mb in step.microbatches():
            x, y = batch_for(ctx.generator(step.index, mb))        # data: a pure function of (seed, step, id)
            step.backward(loss_fn(model(x), y), inputs=(x, y))    # inputs: for the data check
        step.commit(optimizer)

The subpackage also holds the pieces it is built from: fault-tolerant collectives (``comm``), the step
protocol (``protocol``, and its parts ``membership``, ``stepplan``, ``reduction``, ``commit``, ``ckptio``), the
side vector (``sidevec``), the exact reduction's scale (``exact``), the training state and its checkpoints
(``state``, ``checkpoint``), fault injection (``inject``), process life (``process``), MeCeFO's efficient
backward (``efficient``) and the check that data is pure (``datacheck``).
``RunConfig`` and ``load_config`` are the run's config and its loader (``unbroken.core.config``).
"""

from unbroken.core.config import RunConfig, load_config
from unbroken.ft.api import Context, Step, StepOutcome, init
from unbroken.ft.datacheck import generator
from unbroken.ft.mecefo import EfficientBackward, EfficientConfig, apply_efficient_backward

__all__ = [
    "Context",
    "EfficientBackward",
    "EfficientConfig",
    "RunConfig",
    "Step",
    "StepOutcome",
    "apply_efficient_backward",
    "generator",
    "init",
    "load_config",
]
