"""Microbatches addressed by ``(step, microbatch id)``: a pure function of the seed.

Owns the deterministic map from ``(seed, step, mb_id)`` to token windows of a training split (a
``TokenStream``, or a numpy array), and the fixed validation windows of a validation split. Window ``k`` is
ids ``[k*seq_len, k*seq_len + seq_len + 1)`` of the split. Sample ``b`` of microbatch ``j`` of step ``s`` has
the global id ``g = (s*M + j)*microbatch_size + b`` (it does not depend on how many workers there are or
which computes it); it reads window ``P_e(g mod W)`` of epoch ``e = g div W``, where ``P_e`` is a
pseudo-random permutation of the ``W`` windows keyed by ``(seed, e)``, in one of two orders
(``WindowOrder``):

- ``FEISTEL`` (prepared data): a four-round Feistel network over the next power of four, cycle-walked into
  ``[0, W)``, computed per sample in O(1) memory, so a worker's memory does not grow with the corpus (a
  stored permutation of 5 G ids / 256 would be 160 MB per worker);
- ``STORED`` (the text cache of ``unbroken train``, which fits in memory): numpy's
  ``default_rng([seed, e]).permutation(W)``, computed once per epoch: the order runs on text have always had.

It knows nothing about files or formats.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum

import numpy as np
import torch

from unbroken.data.stream import TokenStream

_ROUNDS = 4  # four Feistel rounds make a pseudo-random permutation (Luby-Rackoff)
_SMALL = 16  # up to this many ids at once, plain Python integers are faster than numpy calls
_U64 = (1 << 64) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_M1, _M2 = np.uint64(_C1), np.uint64(_C2)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective 64-bit hash (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _mix_int(x: int) -> int:
    """``_mix`` on one Python integer (the same function)."""
    x ^= x >> 30
    x = (x * _C1) & _U64
    x ^= x >> 27
    x = (x * _C2) & _U64
    return x ^ (x >> 31)


class WindowPermutation:
    """A pseudo-random permutation of ``[0, n)`` keyed by ``(seed, epoch)``, evaluated pointwise.

    Args:
        n: the number of items (>= 1).
        seed: the data-order seed (>= 0).
        epoch: the epoch (>= 0); each epoch has its own permutation.
    """

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        assert n >= 1 and seed >= 0 and epoch >= 0, (n, seed, epoch)
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1  # a balanced Feistel network needs an even number of bits
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = np.random.default_rng([seed, epoch]).integers(0, 2**63, size=_ROUNDS, dtype=np.uint64)
        self._int_keys = [int(k) for k in self._keys]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def _one(self, i: int) -> int:
        half, mask = int(self._half), int(self._mask)
        while True:  # the same network as _feistel, cycle-walked
            left, right = i >> half, i & mask
            for key in self._int_keys:
                left, right = right, left ^ (_mix_int(right ^ key) & mask)
            i = (left << half) | right
            if i < self.n:
                return i

    def __call__(self, i: np.ndarray) -> np.ndarray:
        """The images of ``i`` (int64 in ``[0, n)``)."""
        if len(i) <= _SMALL:
            return np.array([self._one(int(v)) for v in i], dtype=np.int64)
        x = self._feistel(np.asarray(i, dtype=np.uint64))
        out_of_range = x >= np.uint64(self.n)
        while out_of_range.any():  # cycle-walking: stays a bijection on [0, n); < 4 rounds expected
            x[out_of_range] = self._feistel(x[out_of_range])
            out_of_range = x >= np.uint64(self.n)
        return x.astype(np.int64)


class StoredPermutation:
    """numpy's permutation of ``[0, n)`` keyed by ``(seed, epoch)``, held in memory (``WindowOrder.STORED``).

    Args:
        n: the number of items (>= 1).
        seed: the data-order seed (>= 0).
        epoch: the epoch (>= 0); each epoch has its own permutation.
    """

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        assert n >= 1 and seed >= 0 and epoch >= 0, (n, seed, epoch)
        self.n = n
        self._perm = np.random.default_rng([seed, epoch]).permutation(n)

    def __call__(self, i: np.ndarray) -> np.ndarray:
        """The images of ``i`` (int64 in ``[0, n)``)."""
        return self._perm[i].astype(np.int64, copy=False)


class WindowOrder(Enum):
    """How a sampler permutes an epoch's windows (see the module docstring)."""

    FEISTEL = "feistel"  # ``WindowPermutation``: computed per sample, O(1) memory, for prepared data of any size
    STORED = "stored"  # ``StoredPermutation``: the text cache's order


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Non-overlapping windows of ``seq_len + 1`` ids (consecutive windows share one id)."""
    return max(0, (num_tokens - 1) // seq_len)


def gather(tokens: TokenStream | np.ndarray, window_ids: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the windows ``window_ids``: int64, shape (len(window_ids), seq_len) each."""
    if isinstance(tokens, np.ndarray):
        index = window_ids[:, None] * seq_len + np.arange(seq_len + 1)  # (B, seq_len + 1)
        rows = np.asarray(tokens[index], dtype=np.int64)
    else:
        rows = tokens.read_many(window_ids * seq_len, seq_len + 1).astype(np.int64)
    inputs = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))  # (B, seq_len)
    targets = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))  # (B, seq_len)
    return inputs, targets


class PreparedMicrobatchSampler:
    """Training microbatches of prepared data: ``microbatch(step, mb_id)`` (see the module docstring).

    Args:
        tokens: the training split (``PreparedCorpus.train``).
        seq_len: tokens the model sees per sequence.
        microbatch_size: sequences per microbatch.
        microbatches_per_step: M, the microbatches of one optimizer step (mb ids are in ``[0, M)``).
        seed: data-order seed (>= 0).
        order: how an epoch's windows are permuted (``corpus.train_sampler`` picks the corpus's).

    Raises:
        ValueError: a negative seed, or fewer windows than one microbatch.
    """

    _EPOCHS_CACHED = 2

    def __init__(
        self,
        tokens: TokenStream | np.ndarray,
        seq_len: int,
        microbatch_size: int,
        microbatches_per_step: int,
        seed: int,
        order: WindowOrder = WindowOrder.FEISTEL,
    ) -> None:
        assert seq_len >= 1 and microbatch_size >= 1 and microbatches_per_step >= 1
        if seed < 0:
            raise ValueError(f"data seed = {seed} must be >= 0")
        self.tokens = tokens
        self.seq_len = seq_len
        self.microbatch_size = microbatch_size
        self.microbatches_per_step = microbatches_per_step
        self.seed = seed
        self.order = order
        self.num_windows = num_windows(len(tokens), seq_len)
        if self.num_windows < microbatch_size:
            raise ValueError(
                f"the training split has {len(tokens)} tokens = {self.num_windows} windows of "
                f"{seq_len + 1} tokens, fewer than microbatch_size = {microbatch_size}; "
                "lower data.seq_len or data.microbatch_size, or prepare more text"
            )
        self._perms: dict[int, WindowPermutation | StoredPermutation] = {}

    def _perm(self, epoch: int) -> WindowPermutation | StoredPermutation:
        perm = self._perms.get(epoch)
        if perm is None:
            kind = WindowPermutation if self.order is WindowOrder.FEISTEL else StoredPermutation
            perm = kind(self.num_windows, self.seed, epoch)
            if len(self._perms) >= self._EPOCHS_CACHED:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def sample_ids(self, step: int, mb_id: int) -> np.ndarray:
        """The global sample ids (int64, length ``microbatch_size``) of microbatch ``mb_id`` of ``step``."""
        assert step >= 0 and 0 <= mb_id < self.microbatches_per_step, (step, mb_id)
        first = (step * self.microbatches_per_step + mb_id) * self.microbatch_size
        return first + np.arange(self.microbatch_size, dtype=np.int64)

    def window_ids(self, step: int, mb_id: int) -> np.ndarray:
        """Window indices (int64, length ``microbatch_size``) of microbatch ``mb_id`` of ``step``."""
        g = self.sample_ids(step, mb_id)  # consecutive: at most a few epochs, each a contiguous run
        first, last = int(g[0]) // self.num_windows, int(g[-1]) // self.num_windows
        parts = []
        for epoch in range(first, last + 1):
            lo, hi = max(int(g[0]), epoch * self.num_windows), min(int(g[-1]) + 1, (epoch + 1) * self.num_windows)
            parts.append(self._perm(epoch)(np.arange(lo, hi, dtype=np.int64) - epoch * self.num_windows))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def microbatch(self, step: int, mb_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): int64 tensors of shape (microbatch_size, seq_len), targets shifted by one."""
        return gather(self.tokens, self.window_ids(step, mb_id), self.seq_len)


class EvalSampler:
    """Fixed validation microbatches: ``microbatch(k)`` holds consecutive windows ``k*B .. k*B + B - 1``.

    Windows wrap around the validation split when ``k`` runs past it. The same ``k`` always gives the same
    tokens, so validation losses are comparable across evaluations and runs; iterating yields
    ``microbatch(0) .. microbatch(count - 1)``.

    Args:
        tokens: the validation split (``PreparedCorpus.val``, or a numpy array).
        seq_len: tokens the model sees per sequence.
        microbatch_size: sequences per microbatch.
        count: microbatches per evaluation.

    Raises:
        ValueError: the split is shorter than one window.
    """

    def __init__(self, tokens: TokenStream | np.ndarray, seq_len: int, microbatch_size: int, count: int) -> None:
        assert seq_len >= 1 and microbatch_size >= 1 and count >= 1
        self.tokens = tokens
        self.seq_len = seq_len
        self.microbatch_size = microbatch_size
        self.count = count
        self.num_windows = num_windows(len(tokens), seq_len)
        if self.num_windows < 1:
            raise ValueError(
                f"the validation split has {len(tokens)} tokens, less than one window of {seq_len + 1}; "
                "raise data.val_fraction or lower data.seq_len"
            )

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for k in range(self.count):
            yield self.microbatch(k)

    def window_ids(self, k: int) -> np.ndarray:
        assert k >= 0, k
        first = k * self.microbatch_size
        return (first + np.arange(self.microbatch_size, dtype=np.int64)) % self.num_windows

    def microbatch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of validation microbatch ``k``, shapes (microbatch_size, seq_len)."""
        return gather(self.tokens, self.window_ids(k), self.seq_len)
