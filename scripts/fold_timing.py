"""Per-operation times behind docs/benchmarks.md's "where the time goes" table: the `small` model's
gradients (7.4 M values, one thread), median of 9 repetitions, in ms.

    python scripts/fold_timing.py
"""

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from unbroken.ft.comm import GradientReducer
from unbroken.ft.foldkernel import peak
from unbroken.train.model import Transformer, model_args


def median_ms(fn, repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(model_args("small", vocab_size=8192, n_kv_heads=None, max_seq_len=256))
    params = list(model.parameters())
    tokens, targets = torch.randint(0, 8192, (2, 256)), torch.randint(0, 8192, (2, 256))

    def forward_backward() -> None:
        for p in params:
            p.grad = None
        logits = model(tokens)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()

    forward_backward()
    grads = [p.grad.clone() for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    accumulator = torch.zeros(flat.numel(), dtype=torch.int64)
    reducer = GradientReducer(params, 25 * 2**20, 4, exact=True)
    reducer.set_exponents([40] * len(params), 2.0**59)

    def torch_fold() -> None:
        """What one microbatch's fold was until the kernels: the torch ops, a pass each."""
        offset = 0
        for g in grads:
            low, high = torch.aminmax(g)
            float(low), float(high)
            view = accumulator[offset : offset + g.numel()]
            view.add_(torch.from_numpy(g.reshape(-1).mul(2.0**40).round_().numpy().astype(np.int64)))
            offset += g.numel()

    def fold(microbatches: int) -> Callable[[], None]:
        """The reducer's fold of ``microbatches`` microbatches' gradients (the kernels sum up to PENDING_FOLDS
        of them in one pass), through to its reduced buffer."""

        def run() -> None:
            reducer.reset_local()
            for microbatch in range(microbatches):
                for p, g in zip(params, grads, strict=True):
                    p.grad = g
                reducer.fold(microbatch)
            for b in range(len(reducer.buckets)):
                reducer._fill_bucket(b)

        return run

    rows = {
        "fp32, vector_norm(inf) of the reduced gradient": lambda: torch.linalg.vector_norm(flat, float("inf")),
        "fp32, sum of the reduced gradient": lambda: flat.sum(),
        "exact, _foreach_norm(inf) per tensor": lambda: torch._foreach_norm(grads, float("inf")),
        "exact, aminmax per tensor": lambda: [torch.aminmax(g) for g in grads],
        "exact, peak per tensor (kernel)": lambda: [peak(g) for g in grads],
        "exact, one microbatch's fold by torch's ops": torch_fold,
        "exact, fold of 1 microbatch and fill (kernel)": fold(1),
        "exact, fold of 4 microbatches and fill (kernel)": fold(4),
        "exact, int64 back to float32 (apply)": reducer.apply,
        "forward + backward of one microbatch (2 x 256 tokens)": forward_backward,
    }
    print(f"{sum(p.numel() for p in params) / 1e6:.1f} M parameters, 1 thread; median ms of 9")
    for name, fn in rows.items():
        print(f"| {name} | {median_ms(fn):.1f} |")


if __name__ == "__main__":
    main()
