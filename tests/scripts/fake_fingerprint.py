"""examples/plain_loop.py, but some workers report another machine's fingerprint (unbroken.core.numerics): worker 2
from its start, worker 1 once it is restarted. Worker 0 waits at step 4 until the coordinator has refused the
restarted worker 1 (read from the run's metrics), so the refusal at join happens while the run goes on.

    unbroken launch --workers 3 --recovery.reduction=exact \
        --failures.schedule="kill:worker=1,step=2,phase=backward,rejoin=0.5" tests/scripts/fake_fingerprint.py
"""

import json
import os
import sys
import time
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import torch  # noqa: E402
from plain_loop import TinyLM, batch_for  # noqa: E402

import unbroken.ft as ft  # noqa: E402
from unbroken.ft import determinism  # noqa: E402

WAIT_S = 120.0


def fake_fingerprint() -> None:
    worker = os.environ["UNBROKEN_WORKER_ID"]
    started = Path(os.environ["UNBROKEN_TEST_FAKE_FINGERPRINT_DIR"]) / f"started-{worker}"
    restarted = started.exists()
    started.touch()
    if worker == "2" or (worker == "1" and restarted):
        real = determinism.local_fingerprint
        determinism.local_fingerprint = lambda device: {**real(device), "cpu_isa": "ANOTHER-ISA"}


def refused(run_dir: Path, worker: int) -> bool:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return any(json.loads(line).get("type") == "refused" and json.loads(line)["worker"] == worker for line in lines)


def main() -> None:
    fake_fingerprint()
    ctx = ft.init()
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctx.register_state(model, optimizer)
    for step in ctx.steps():
        if step.index == 4 and ctx.worker_id == 0:
            deadline = time.monotonic() + WAIT_S
            while not refused(ctx.run_dir, 1) and time.monotonic() < deadline:
                time.sleep(0.1)
        for mb in step.microbatches():
            x, y = batch_for(0, step.index, mb)
            step.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        step.commit(optimizer)


if __name__ == "__main__":
    main()
