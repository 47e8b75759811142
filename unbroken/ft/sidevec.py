"""The side vector: the small float64 vector every member SUM-reduces with its gradient in each step.

Owns its layout (named fields at fixed offsets) and its encoding and decoding; nothing else indexes it.
What each member contributes, and what the sum means:

  loss[M]          per microbatch id: the loss of that microbatch (from whoever computed it)
  tokens[M]        per id: the tokens it trained on (as the user's loop reported them)
  counted[M]       per id: how many members computed it (must be exactly one, ``drop``: zero or one)
  efficient[M]     per id: 1 if it was computed in MeCeFO's efficient mode
  nonfinite[M]     per id: 1 if its gradient held a NaN or an infinity
  overflow         microbatches whose gradient did not fit the exact mode's fixed point
  seconds[W]       per worker slot: that worker's seconds per microbatch (the throughput workload)
  bad_param[W]     per worker slot: 1 + the index of the first parameter whose gradient is not finite (a rank of
                   a replica of several ranks: in its own worker's slot, the model's index of the parameter)
  epoch_sum        every member adds its group's epoch: equals epoch x members when they agree
  members          every member adds one: equals the group's size
  newest_epoch     the leader's newest known epoch: every member takes joiners in at the same boundary
  probe[2]         the data check's fingerprints of one microbatch's inputs (``datacheck``): [0] from whoever
                   computed it, [1] from the member that computed it again; 0 when not computed

Worker ids at or above ``WORKER_SLOTS`` have no slot (their speed is not known to the planner).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WORKER_SLOTS = 256


@dataclass(frozen=True)
class Reduced:
    """A decoded side vector (the sum over the members, or one member's own contribution)."""

    loss: list[float]
    tokens: list[int]
    counted: list[int]
    efficient: list[int]
    nonfinite: list[int]
    overflow: int
    seconds: dict[int, float]  # worker id -> seconds per microbatch, for the slots that are set
    bad_param: dict[int, int]  # worker id -> index of its first non-finite parameter
    epoch_sum: int
    members: int
    newest_epoch: int
    probe: tuple[float, float] = (0.0, 0.0)


class SideVector:
    """The layout for M microbatch ids; ``encode`` and ``decode`` are inverse on well-formed values."""

    def __init__(self, num_microbatches: int) -> None:
        assert num_microbatches >= 1
        self.M = num_microbatches
        self.fields: dict[str, slice] = {}
        offset = 0
        for name, size in (
            ("loss", self.M),
            ("tokens", self.M),
            ("counted", self.M),
            ("efficient", self.M),
            ("nonfinite", self.M),
            ("overflow", 1),
            ("seconds", WORKER_SLOTS),
            ("bad_param", WORKER_SLOTS),
            ("epoch_sum", 1),
            ("members", 1),
            ("newest_epoch", 1),
            ("probe", 2),
        ):
            self.fields[name] = slice(offset, offset + size)
            offset += size
        self.size = offset

    def encode(
        self,
        *,
        worker: int,
        losses: dict[int, float],
        tokens: dict[int, int],
        done: list[int],
        efficient: list[int],
        nonfinite: list[int],
        overflow: int,
        seconds: float,
        bad_param: int | None,
        epoch: int,
        newest_epoch: int = 0,
        member: bool = True,
        bad_worker: int | None = None,
        probe: tuple[float, float] = (0.0, 0.0),
    ) -> torch.Tensor:
        """One member's contribution: ``losses`` (and ``tokens``) of the ids it computed, the ids it counts
        (``done``), which ran in efficient mode and which had a non-finite gradient, its overflowed microbatches,
        its seconds per microbatch, the index of its first non-finite parameter, its group's epoch, and (leader
        only) the newest epoch. The ranks of a replica of several ranks each encode their own part and sum them:
        one of them counts the replica's ids and is the ``member`` (the others pass no ids, no epoch). ``probe``: this
        member's fingerprints for the data check (``datacheck``), 0 where it computed none."""
        out = torch.zeros(self.size, dtype=torch.float64)
        f = self.fields
        for j, value in losses.items():
            out[f["loss"].start + j] = value
            out[f["tokens"].start + j] = tokens.get(j, 0)
        for j in done:
            out[f["counted"].start + j] += 1
        for j in efficient:
            out[f["efficient"].start + j] += 1
        for j in nonfinite:
            out[f["nonfinite"].start + j] = 1
        out[f["overflow"].start] = overflow
        if worker < WORKER_SLOTS:
            out[f["seconds"].start + worker] = seconds
        slot = worker if bad_worker is None else bad_worker  # the worker that saw it (a rank: its own slot)
        if bad_param is not None and slot < WORKER_SLOTS:
            out[f["bad_param"].start + slot] = bad_param + 1
        out[f["epoch_sum"].start] = epoch
        out[f["members"].start] = 1 if member else 0
        out[f["newest_epoch"].start] = newest_epoch
        out[f["probe"]] = torch.tensor(probe, dtype=torch.float64)
        return out

    def decode(self, vector: torch.Tensor) -> Reduced:
        assert vector.numel() == self.size and vector.dtype == torch.float64
        v = vector.tolist()
        f = self.fields

        def part(name: str) -> list[float]:
            return v[f[name]]

        def one(name: str) -> int:
            return int(v[f[name].start])

        return Reduced(
            loss=part("loss"),
            tokens=[int(t) for t in part("tokens")],
            counted=[int(c) for c in part("counted")],
            efficient=[int(c) for c in part("efficient")],
            nonfinite=[int(c) for c in part("nonfinite")],
            overflow=one("overflow"),
            seconds={w: s for w, s in enumerate(part("seconds")) if s > 0},
            bad_param={w: int(b) - 1 for w, b in enumerate(part("bad_param")) if b > 0},
            epoch_sum=one("epoch_sum"),
            members=one("members"),
            newest_epoch=one("newest_epoch"),
            probe=(part("probe")[0], part("probe")[1]),
        )
