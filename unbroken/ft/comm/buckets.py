"""Which parameters the gradient reducer reduces together: ``Buckets``, the layout of its flat buffer.

Buckets hold parameters in reverse registration order (the order backward produces their gradients), each
bucket closed once it holds ``bucket_bytes``; a small first bucket (DDP's policy) starts the reduction of the last
layers' gradients while the rest of the backward runs. Under FSDP its units give the buckets instead (the order
their reduce-scatters make gradients final: ``parallel.fsdp.fsdp_buckets``). A parameter's slice of the flat
buffer is contiguous, and a bucket's slices are adjacent, so each bucket is reduced as one range.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Buckets:
    """The buckets (lists of parameter indices, in launch order) over parameters of ``numels`` elements of
    ``element_bytes`` each, and where each parameter sits in the flat buffer (``offsets``; a bucket's range:
    ``ranges``; the buffer's length: ``total``)."""

    def __init__(
        self,
        numels: Sequence[int],
        bucket_bytes: int,
        element_bytes: int,
        first_bucket_bytes: int | None = None,
        buckets: list[list[int]] | None = None,
    ) -> None:
        self.numels = list(numels)
        if buckets is None:
            self.buckets = self._in_backward_order(bucket_bytes, element_bytes, first_bucket_bytes)
        else:
            assert sorted(i for b in buckets for i in b) == list(range(len(self.numels))), "every parameter once"
            self.buckets = [list(b) for b in buckets]
        self.offsets: list[int] = [0] * len(self.numels)
        self.ranges: list[tuple[int, int]] = []
        offset = 0
        for bucket in self.buckets:
            start = offset
            for index in bucket:
                self.offsets[index] = offset
                offset += self.numels[index]
            self.ranges.append((start, offset))
        self.total = offset
        self.bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}

    def _in_backward_order(self, bucket_bytes: int, element_bytes: int, first_bytes: int | None) -> list[list[int]]:
        first = bucket_bytes if first_bytes is None else first_bytes
        buckets: list[list[int]] = []
        current: list[int] = []
        current_bytes = 0
        for index in reversed(range(len(self.numels))):
            current.append(index)
            current_bytes += self.numels[index] * element_bytes
            if current_bytes >= (bucket_bytes if buckets else first):
                buckets.append(current)
                current, current_bytes = [], 0
        if current:
            buckets.append(current)
        return buckets

    def __len__(self) -> int:
        return len(self.buckets)

    def view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s slice of ``buffer`` (the flat buffer, or one of its length)."""
        return buffer[self.offsets[index] : self.offsets[index] + self.numels[index]]
