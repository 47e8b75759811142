"""Every wire and file format has one owner, and each round-trips: the side vector, metrics records, the
store-key schema, the training state, and the exact reduction's fixed-point scale with its rules."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.control.store import keys
from unbroken.core.records import (
    FIELDS,
    QUOTAS_AT,
    ErrorPhase,
    MetricsFile,
    RecordKind,
    WorkerError,
    append_records,
    decode,
    encode,
    make,
    read_records,
)
from unbroken.ft.checkpoint import schema as ckpt
from unbroken.ft.exact import MAX_BOUND_EXP, MIN_BOUND_EXP, FixedPointScale
from unbroken.ft.sidevec import WORKER_SLOTS, SideVector
from unbroken.ft.state import StepOutcome, TrainingState

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 12),
    data=st.data(),
)
def test_side_vector_round_trip_and_sum(m: int, data: st.DataObject) -> None:
    side = SideVector(m)
    members = data.draw(st.lists(st.integers(0, WORKER_SLOTS - 1), min_size=1, max_size=4, unique=True))
    ids = list(range(m))
    owner = {j: data.draw(st.sampled_from(members)) for j in ids}
    total = torch.zeros(side.size, dtype=torch.float64)
    contributions = {}
    for w in members:
        done = [j for j in ids if owner[j] == w]
        c = {
            "worker": w,
            "losses": {j: float(j) + 0.5 for j in done},
            "tokens": {j: 100 + j for j in done},
            "done": done,
            "efficient": done[:1],
            "nonfinite": done[1:2],
            "overflow": len(done) % 2,
            "seconds": 0.25 + w,
            "bad_param": w if done[1:2] else None,
            "epoch": 7,
            "newest_epoch": 9 if w == members[0] else 0,
        }
        contributions[w] = c
        total += side.encode(**c)
    r = side.decode(total)
    assert r.counted == [1] * m and r.loss == [j + 0.5 for j in ids] and r.tokens == [100 + j for j in ids]
    assert r.members == len(members) and r.epoch_sum == 7 * len(members) and r.newest_epoch == 9
    assert r.seconds == {w: 0.25 + w for w in members}
    assert r.bad_param == {w: w for w, c in contributions.items() if c["bad_param"] is not None}
    assert sum(r.efficient) == sum(len(c["efficient"]) for c in contributions.values())
    assert r.overflow == sum(c["overflow"] for c in contributions.values())


def test_every_record_kind_round_trips_and_a_missing_field_is_a_bug(tmp_path: Path) -> None:
    samples = [make(kind, 1.5, **{f: i for i, f in enumerate(sorted(FIELDS[kind]))}) for kind in RecordKind]
    writer = MetricsFile(tmp_path)
    for record in samples:
        assert decode(encode(record)) == record
        writer.write(record)
    writer.close()
    assert read_records(tmp_path) == samples
    assert [r["type"] for r in read_records(tmp_path, "step")] == ["step"]
    with pytest.raises(AssertionError, match="lacks"):
        make(RecordKind.STEP, 0.0, step=1)
    # a torn last line (a writer killed mid-line) is skipped, and appending ends it first
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"type": "step", "st')
    assert read_records(tmp_path) == samples
    append_records(tmp_path, [samples[0], make(RecordKind.USER, 2.0, note="after")])
    assert read_records(tmp_path) == [*samples, make(RecordKind.USER, 2.0, note="after")]  # no duplicate


def _step(step: int, quotas: dict[str, int]) -> dict:
    fields = {f: 0 for f in FIELDS[RecordKind.STEP] if f != "step"}
    return make(RecordKind.STEP, 10.0 + step, step=step, **fields, quotas=quotas, speeds={"0": 0.1 * step})


def test_unchanged_quotas_are_written_once_and_read_back_in_full(tmp_path: Path) -> None:
    """The file names a step's quotas where they changed and refers to that record after; every reader gets
    them back in full, a reference whose record is missing gives none (never another step's), and a record
    sent again in either form is recognised as written."""
    even, uneven = {"0": 2, "1": 2}, {"0": 3, "1": 1}
    plan = [even, even, even, uneven, even, even]
    records = [_step(s, q) for s, q in enumerate(plan)]
    writer = MetricsFile(tmp_path)
    writer.write(records[0])
    writer.write(make(RecordKind.EVAL, 10.5, step=0, val_loss=1.0, val_ppl=2.7))
    writer.write_line(encode(records[1]))  # as a worker publishes it
    writer.write_line(encode(records[2]), records[2])  # with its decoding, as the coordinator hands it on
    for record in records[3:]:
        writer.write(record)
    writer.close()
    written = [decode(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    in_full = [r["step"] for r in written if r["type"] == "step" and "quotas" in r]
    assert in_full == [0, 3, 4]
    assert [r.get(QUOTAS_AT) for r in written if r["type"] == "step"] == [None, 0, 0, None, None, 4]
    assert read_records(tmp_path, "step") == records
    # a coordinator started again on the file writes its first step record in full
    again = MetricsFile(tmp_path)
    again.write(_step(6, even))
    again.close()
    assert "quotas" in decode((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    # the records a worker still holds, full, after its coordinator died: already there, not appended again
    size = (tmp_path / "metrics.jsonl").stat().st_size
    append_records(tmp_path, records[1:])
    assert (tmp_path / "metrics.jsonl").stat().st_size == size
    # a file that lost its first lines: the steps that referred to them have no quotas
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[1:]) + "\n")
    steps = read_records(tmp_path, "step")
    assert [r["step"] for r in steps if "quotas" not in r] == [1, 2]
    assert [r["quotas"] for r in steps if "quotas" in r] == [uneven, even, even, even]


def test_a_worker_error_round_trips_through_the_store_and_metrics() -> None:
    """The report a dying worker writes to the store (``keys.error``) and the record the coordinator makes of it."""
    for microbatch, phase in ((3, ErrorPhase.MICROBATCH), (None, ErrorPhase.BETWEEN_STEPS)):
        error = WorkerError(2, "ValueError", "bad", "/x/train.py", 12, "loss_fn", phase, 5, microbatch, "Traceback")
        assert WorkerError.decode(error.encode()) == error
        record = decode(encode(error.record(1.5)))
        assert record is not None and record["type"] == "error" and WorkerError.from_record(record) == error
    with pytest.raises(ValueError, match="not a worker error report"):
        WorkerError.decode('{"worker": 1}')


def test_the_key_schema_lists_every_key_it_defines() -> None:
    """control/store/keys.py's table names each key it builds (one place a key is spelled)."""
    table = keys.__doc__
    builders = [getattr(keys, n) for n in dir(keys) if callable(getattr(keys, n)) and not n.startswith("_")]
    for build in builders:
        args = [3] * build.__code__.co_argcount
        key = build(*args) if build is not keys.doorbell else build("bell", 3)
        if build is keys.doorbell_seq:
            key = build("bell")
        pattern = re.sub(r"\d+", "<", key).split("<")[0]
        assert pattern in table, (build.__name__, key)
    for name in ("CONFIG", "RUN_DIR", "EXPECTED", "RESUME", "REGISTER_SEQ", "EPOCH", "METRICS_SEQ", "DONE", "STOP"):
        assert getattr(keys, name) in table, name


def test_the_scale_fits_what_it_grew_for_and_follows_the_gradient() -> None:
    scale = FixedPointScale(3, num_microbatches=8)
    limit = scale.limit
    observed = [3.0e5, 1e-3, 0.0]
    grown = scale.grow(observed)
    assert grown == [0]  # only what did not fit below the initial bound of 1
    for value, e in zip(observed, scale.exponents(), strict=True):
        assert value * 2.0**e < limit  # a redo with the grown scale fits
        assert 8 * limit <= 2.0**63  # and M such values sum inside int64
    scale.track([1e-6, 2.0, 0.0])
    assert scale.bound_exp == [math.frexp(1e-6)[1] + 10, math.frexp(2.0)[1] + 10, MIN_BOUND_EXP]
    scale.grow([3.0e38, 0.0, 0.0])  # the largest float32s: capped, and still fits
    assert scale.bound_exp[0] == MAX_BOUND_EXP and 3.0e38 * 2.0 ** scale.exponents()[0] < limit
    again = FixedPointScale(3, 8)
    again.load_state_dict(scale.state_dict())
    assert again.bound_exp == scale.bound_exp
    with pytest.raises(ValueError, match="does not fit"):
        FixedPointScale(3, 16).load_state_dict(scale.state_dict())


def test_the_training_state_round_trips_through_the_checkpoint_schema() -> None:
    def build(seed: int) -> TrainingState:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        state = TrainingState()
        state.model, state.optimizer = model, opt
        state.extra = {"cursor": {"position": torch.tensor(seed)}}
        state.scale = FixedPointScale(2, 4)
        return state

    a, b = build(0), build(1)
    a.step, a.speeds, a.nonfinite_streak = 12, {0: 0.5, 3: 0.25}, 2
    a.last = StepOutcome(loss=1.5, grad_norm=0.5, lr=0.1, recomputed=1)
    a.scale.grow([10.0, 0.0])
    b.restore(ckpt.decode(ckpt.encode(a.snapshot())))
    assert b.checksum() == a.checksum() and b.step == 12 and b.speeds == a.speeds and b.last == a.last
    assert b.nonfinite_streak == 2 and b.scale.bound_exp == a.scale.bound_exp
    assert torch.equal(b.extra["cursor"]["position"], torch.tensor(0))
    assert b.optimizer.state_dict()["state"][0]["step"] == a.optimizer.state_dict()["state"][0]["step"]
    other = TrainingState()
    other.model = torch.nn.Linear(5, 3)
    with pytest.raises(ValueError, match="different model"):
        other.restore(a.snapshot())
