"""The console tells a run's story in order (``control.console``: the pipe's line format and ``Story``;
``control.progress.ProgressView``): the leader's prints, tagged ``[worker N]``, come after the launcher's lines of
their step; a re-formation's lines (the failure, then the new epoch) stand where the group re-formed, before the
recovery or rejoin line, epochs in order; every committed step is said, alone (``step 5 | ...``) or in a range
(``steps 6-9 | ...``), never skipped. Pure tests drive the ordering with records in the orders the coordinator
writes them and a clock of their own; one real launch (3 worker processes, a kill mid-step, the restarted worker
rejoining) is checked line by line with the same checker, which is shown to fire on misordered consoles first.
The stop line of a bug (printed once, steps from 0) is tests/test_user_errors.py's."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from runner import ONE_THREAD, run_command

from unbroken.control.console import (
    Channel,
    ConsoleRelay,
    ConsoleTee,
    LeaderLine,
    Story,
    decode_line,
    encode_line,
)
from unbroken.control.status.progress import ProgressView
from unbroken.core.records import RecordKind, make, read_records

# -- the checker ---------------------------------------------------------------------------------------------------
PROGRESS = re.compile(r"^step (\d+) \| loss |^steps (\d+)-(\d+) \| mean loss ")
LEADER = re.compile(r"^\[worker (\d+)\] committed step (\d+)$")
REFORMED = re.compile(
    r"^step (\d+) goes on with \d+ workers \(epoch (\d+)\)|^worker [\d, ]+ rejoined at step (\d+) \(epoch (\d+),"
)
MEMBERSHIP = re.compile(r"^epoch (\d+): members ")


def story_violations(console: list[str], steps: int) -> list[str]:
    """What is out of the run's order in ``console`` (the plain lines of a launch of a script that prints
    ``committed step N`` on its leader): each line has a place in the story (a re-formation in step s before
    step s's progress line, before the leader's lines of step s; a new epoch's line where its group re-formed),
    and no line may come after a line of a later place; every step 0..steps-1 is said by exactly one progress
    line, in order; the epochs named never go back."""
    reformed_in = {int(m[2] or m[4]): int(m[1] or m[3]) for m in map(REFORMED.match, console) if m}
    problems: list[str] = []
    latest: tuple[tuple[int, int], str] = ((-1, 0), "")  # the latest place said so far, and its line
    said: list[int] = []
    epochs: list[int] = []
    for line in console:
        place: tuple[tuple[int, int], tuple[int, int]] | None = None  # (first, last) place the line covers
        if m := PROGRESS.match(line):
            first, last = (int(m[1]), int(m[1])) if m[1] else (int(m[2]), int(m[3]))
            if said[-1:] != [first - 1] and not (first == 0 and not said):
                problems.append(f"{line!r}: the steps said before it end at {said[-1:]}")
            said += range(first, last + 1)
            place = ((first, 1), (last, 1))
        elif m := LEADER.match(line):
            place = ((int(m[2]), 2),) * 2
        elif m := REFORMED.match(line):
            place = ((int(m[1] or m[3]), 0),) * 2
            epochs.append(int(m[2] or m[4]))
        elif (m := MEMBERSHIP.match(line)) and int(m[1]) in reformed_in:
            place = ((reformed_in[int(m[1])], 0),) * 2
            epochs.append(int(m[1]))
        if place is None:
            continue
        if place[0] < latest[0]:
            problems.append(f"{line!r} comes after {latest[1]!r}")
        if place[1] > latest[0]:
            latest = (place[1], line)
    if said != list(range(steps)):
        problems.append(f"the progress lines say steps {said}, not 0-{steps - 1} once each")
    if epochs != sorted(epochs):
        problems.append(f"the epochs go back: {epochs}")
    return problems


GOOD = [
    "epoch 1: members [0, 1, 2] (start)",
    "step 0 | loss 3.0000 | lr 1.0e-02 | 10 ms | 1,000 tok/s | alive 3 | 1/8 done",
    "[worker 0] committed step 0",
    "steps 1-2 | mean loss 2.0000 | lr 1.0e-02 | 10 ms/step | 1,000 tok/s | alive 3 | 3/8 done",
    "worker 1 failed: kill:worker=1,step=3,phase=backward",
    "epoch 2: members [0, 2] (died: 1)",
    "step 3 goes on with 2 workers (epoch 2)",
    "step 3 | loss 3.0000 | lr 1.0e-02 | 10 ms | 1,000 tok/s | alive 2 | 4/8 done",
    "[worker 0] committed step 3",
    "steps 4-5 | mean loss 2.0000 | lr 1.0e-02 | 10 ms/step | 1,000 tok/s | alive 2 | 6/8 done",
    "epoch 3: members [0, 1, 2] (joined: 1)",
    "worker 1 rejoined at step 6 (epoch 3, 3 alive)",
    "steps 6-7 | mean loss 2.0000 | lr 1.0e-02 | 10 ms/step | 1,000 tok/s | alive 3 | 8/8 done",
]


def test_the_story_checker_passes_an_ordered_console_and_fires_on_each_disorder() -> None:
    assert story_violations(GOOD, 8) == []

    def swapped(a: str, b: str) -> list[str]:
        i, j = GOOD.index(a), GOOD.index(b)
        console = list(GOOD)
        console[i], console[j] = console[j], console[i]
        return console

    step_3 = next(line for line in GOOD if line.startswith("step 3 |"))
    leader_early = swapped("[worker 0] committed step 3", step_3)
    assert any("comes after" in p for p in story_violations(leader_early, 8))
    recovery_late = swapped("step 3 goes on with 2 workers (epoch 2)", "[worker 0] committed step 3")
    assert any("comes after" in p for p in story_violations(recovery_late, 8))
    epoch_late = swapped("epoch 3: members [0, 1, 2] (joined: 1)", "epoch 2: members [0, 2] (died: 1)")
    assert story_violations(epoch_late, 8)
    gap = [line for line in GOOD if not line.startswith("steps 4-5")]
    assert any("end at [3]" in p for p in story_violations(gap, 8))
    straddling = [
        line.replace("steps 1-2", "steps 1-3") if line.startswith("steps 1-2") else line
        for line in GOOD
        if not line.startswith("step 3 |")
    ]
    assert any("comes after" in p for p in story_violations(straddling, 8))


# -- the pipe's line format --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("worker", "step", "text"),
    [(0, 5, "step 5: loss 1.2345"), (None, -1, ""), (12, 0, "  spaced  out "), (3, 7, "7 8")],
)
def test_a_console_line_round_trips(worker: int | None, step: int, text: str) -> None:
    encoded = encode_line(worker, step, text)
    assert encoded.endswith(b"\n") and encoded.count(b"\n") == 1
    assert decode_line(encoded[:-1]) == LeaderLine(worker, step, text)


def test_an_untagged_line_is_shown_whole_at_once() -> None:
    for text in ("hello", "a b", "x 5 text", "0 y text", ""):
        assert decode_line(text.encode()) == LeaderLine(None, -1, text)
    assert LeaderLine(None, -1, "hi").shown() == "[leader] hi"
    assert LeaderLine(2, 4, "hi").shown() == "[worker 2] hi"


def test_the_tee_tags_each_line_with_the_worker_and_step_of_its_print() -> None:
    """A real pipe: what the worker prints while it speaks reaches the relay with the place it was printed at, a
    line split over several writes once, and nothing while it does not speak."""
    relay = ConsoleRelay()
    try:
        log: list[str] = []

        class Log:
            def write(self, text: str) -> int:
                log.append(text)
                return len(text)

        place = [(0, -1)]
        speaking = [True]
        tee = ConsoleTee(Log(), relay.write_fd, lambda: speaking[0], lambda: place[0])  # type: ignore[arg-type]
        tee.write("before the first step\n")
        place[0] = (0, 3)
        tee.write("half a ")
        tee.write("line\nand another\n")
        speaking[0] = False
        tee.write("not the leader now\n")
        speaking[0], place[0] = True, (1, 4)
        tee.write("the new leader\n")
        assert relay.drain_lines() == [
            LeaderLine(0, -1, "before the first step"),
            LeaderLine(0, 3, "half a line"),
            LeaderLine(0, 3, "and another"),
            LeaderLine(1, 4, "the new leader"),
        ]
        assert "".join(log).count("\n") == 5  # the log has every line
    finally:
        relay.close()


# -- Story: the order --------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def story(hold_s: float = 5.0) -> tuple[Story, list[str], Clock]:
    out: list[str] = []
    clock = Clock()
    return Story(lambda text, channel: out.append(f"{channel.value}: {text}"), clock, hold_s), out, clock


def test_a_leader_line_waits_for_the_records_of_its_step_and_the_lines_keep_their_order() -> None:
    s, out, _ = story()
    s.script(LeaderLine(0, -1, "setting up"))
    assert out == ["script: [worker 0] setting up"]  # before any step: at once
    s.script(LeaderLine(0, 0, "step 0 done"))
    s.script(LeaderLine(0, 1, "step 1 done"))
    s.script(LeaderLine(0, 0, "late, of step 0"))  # behind step 1's line: printed after it
    assert len(out) == 1
    s.reached(step=0)
    assert out[1:] == ["script: [worker 0] step 0 done"]
    s.reached(step=1)
    assert out[2:] == ["script: [worker 0] step 1 done", "script: [worker 0] late, of step 0"]


def test_a_new_epoch_waits_for_the_group_to_re_form_and_epochs_come_in_order() -> None:
    """The coordinator writes a death's epoch (2) and a rejoin's (3) before the leader's records of the steps
    before them reach the file: each is shown where the group re-formed into it, failures first."""
    s, out, _ = story()
    s.say("epoch 2: members [0, 2] (died: 1)", epoch=2, rank=2)
    s.say("worker 1 failed", epoch=2, rank=1)
    s.say("epoch 3: members [0, 1, 2] (joined: 1)", epoch=3, rank=2)
    s.reached(step=4, epoch=1)
    s.say("step 4")
    assert out == ["progress: step 4"]
    s.reached(epoch=2)
    s.say("step 5 goes on with 2 workers (epoch 2)")
    assert out[1:] == [
        "progress: worker 1 failed",
        "progress: epoch 2: members [0, 2] (died: 1)",
        "progress: step 5 goes on with 2 workers (epoch 2)",
    ]
    s.reached(step=5, epoch=2)
    assert len(out) == 4  # epoch 3 still waits for its re-formation
    s.reached(epoch=3)
    assert out[4:] == ["progress: epoch 3: members [0, 1, 2] (joined: 1)"]
    s.say("at once", epoch=3)  # an epoch already reached: not held
    assert out[-1] == "progress: at once"


def test_a_line_held_for_an_epoch_goes_once_its_step_is_done_if_no_re_formation_comes() -> None:
    s, out, _ = story()
    s.say("worker 2 raised ...", Channel.ERROR, epoch=2, step=5)
    s.reached(step=4, epoch=1)
    assert out == []
    s.reached(step=5, epoch=1)
    assert out == ["error: worker 2 raised ..."]


def test_what_is_held_goes_after_a_silence_a_new_session_or_the_end() -> None:
    s, out, clock = story(hold_s=5.0)
    s.script(LeaderLine(0, 3, "in a long step"))
    s.say("epoch 2", epoch=2)
    clock.now = 4.0
    s.heard()  # a record: not silent
    clock.now = 8.0
    s.tick()
    assert out == []
    clock.now = 9.0
    s.tick()
    assert out == ["progress: epoch 2", "script: [worker 0] in a long step"]
    s.script(LeaderLine(0, 9, "of the last session"))
    s.new_session()
    assert out[-1] == "script: [worker 0] of the last session" and (s.step, s.epoch) == (-1, 0)
    s.script(LeaderLine(0, 0, "the new session's step 0"))
    s.release_all()
    assert out[-1] == "script: [worker 0] the new session's step 0"


@pytest.mark.parametrize("seed", range(5))
def test_no_line_is_lost_or_shown_twice_in_any_interleaving(seed: int) -> None:
    """Leader lines, held and immediate launcher lines and progress in a seeded random order: after the end each
    line was shown exactly once, the leader's in the order printed, and no leader line before its step."""
    rng = random.Random(seed)
    s, out, _ = story()
    reached = [-1]
    shown_at: dict[str, int] = {}

    def emit(text: str, channel: Channel) -> None:
        shown_at[text] = reached[0]
        out.append(text)

    s.emit = emit
    said: list[str] = []
    printed: list[LeaderLine] = []
    step, epoch = -1, 1
    for n in range(200):
        action = rng.random()
        if action < 0.3:
            printed.append(LeaderLine(0, step + rng.randint(0, 2), f"leader {n}"))
            s.script(printed[-1])
        elif action < 0.5:
            said.append(f"launcher {n}")
            s.say(said[-1], epoch=epoch + rng.randint(0, 2) if rng.random() < 0.5 else None)
        elif action < 0.9:
            step += 1
            reached[0] = step
            s.reached(step=step)
        else:
            epoch += 1
            s.reached(epoch=epoch)
    reached[0] = 10**9
    s.release_all()
    assert sorted(out) == sorted([line.shown() for line in printed] + said), seed
    assert [x for x in out if x.startswith("[worker")] == [line.shown() for line in printed], seed
    early = [line for line in printed if shown_at[line.shown()] < line.step]
    assert not early, (seed, early)


# -- ProgressView: records in the coordinator's order -----------------------------------------------------------
def step_record(step: int, epoch: int, alive: int = 3) -> dict[str, Any]:
    fields = {"loss": 2.0, "lr": 1e-2, "grad_norm": 1.0, "step_time_s": 0.01, "tokens": 100, "alive": alive}
    fields |= {"microbatches": 6, "committed": True, "recomputed": 0, "dropped": 0, "recoveries": 0, "efficient": 0}
    return make(RecordKind.STEP, 0.0, step=step, epoch=epoch, tokens_per_s=10_000.0, **fields)


def membership(epoch: int, members: list[int], reason: str) -> dict[str, Any]:
    return make(RecordKind.MEMBERSHIP, 0.0, epoch=epoch, members=members, reason=reason, elapsed_s=0.0)


def recovery(step: int, from_epoch: int, epoch: int, alive: int) -> dict[str, Any]:
    fields = {"reform_s": 0.01, "missing": [3], "time_reformed": 0.0, "time_recovered": 0.0}
    return make(RecordKind.RECOVERY, 0.0, step=step, from_epoch=from_epoch, epoch=epoch, alive=alive, **fields)


def test_the_progress_view_tells_a_kill_and_a_rejoin_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    """The order of a real file when the coordinator is quick and the leader's records lag: the death's epoch,
    its failure and the rejoin's epoch are written before the steps that came before them; the leader printed
    every step's line before the launcher read its record. Off a terminal, 8 steps: a line every step."""
    records = [
        membership(1, [0, 1, 2], "start"),
        membership(2, [0, 2], "died: 1"),
        make(RecordKind.FAILURE, 0.0, worker=1, why="killed", epoch=2, event="kill:worker=1,step=3"),
        *(step_record(s, 1) for s in range(3)),
        recovery(3, 1, 2, 2),
        membership(3, [0, 1, 2], "joined: 1"),
        step_record(3, 2, 2),
        *(step_record(s, 2, 2) for s in (4, 5)),
        recovery(6, 2, 3, 3),
        step_record(6, 3),
        step_record(7, 3),
    ]
    with ProgressView(8, enabled=True) as view:
        view.update(make(RecordKind.COORDINATOR, 0.0, incarnation="a", restored_epoch=0, address="x", status="y"))
        for s in range(8):
            view.show(LeaderLine(0, s, f"committed step {s}"))
        for record in records:
            view.update(record)
    console = capsys.readouterr().out.splitlines()
    assert story_violations(console, 8) == [], console
    i = console.index("epoch 2: members [0, 2] (died: 1)")
    assert console[i - 1] == "worker 1 failed: kill:worker=1,step=3"
    assert console[i + 1] == "step 3 goes on with 2 workers (epoch 2); microbatches [3] to redo"
    j = console.index("epoch 3: members [0, 1, 2] (joined: 1)")
    assert console[j + 1] == "worker 1 rejoined at step 6 (epoch 3, 3 alive)" and j > i
    assert [x for x in console if x.startswith("[worker")] == [f"[worker 0] committed step {s}" for s in range(8)]


def test_skipped_progress_lines_are_said_as_ranges(capsys: pytest.CaptureFixture[str]) -> None:
    """40 steps: a line at step 0 and after every second step (``steps 2-3 | ...``); a line of the launcher's or
    the leader's between says the steps before it first; a copy a new leader republishes is not said again."""
    with ProgressView(40, enabled=True) as view:
        view.update(membership(1, [0, 1], "start"))
        for s in range(10):
            view.update(step_record(s, 1, 2))
            if s == 4:
                view.update({**step_record(4, 1, 2), "republished": True})
                view.show(LeaderLine(0, 4, "committed step 4"))
                view.update(make(RecordKind.EVAL, 0.0, step=4, val_loss=2.0, val_ppl=7.4))
    console = capsys.readouterr().out.splitlines()
    assert [line.split(" |")[0] for line in console[1:]] == [
        *("step 0", "step 1", "steps 2-3", "step 4", "[worker 0] committed step 4"),
        *("eval after step 4: val loss 2.0000, ppl 7.4", "step 5", "steps 6-7", "steps 8-9"),
    ]
    assert console[3] == "steps 2-3 | mean loss 2.0000 | lr 1.0e-02 | 10 ms/step | 10,000 tok/s | alive 2 | 4/40 done"


def test_quiet_shows_the_leader_and_the_errors_in_order_and_a_stop_says_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--quiet``: no progress lines, but the leader's prints and a worker's error in the story's order. A stop
    ends the story (what was held is shown); its reason is the launcher's last line, not the view's."""
    error = {
        "worker": 1, "exception": "RuntimeError", "message": "bad", "file": "/x/train.py", "line": 3,
        "function": "f", "phase": "microbatch", "step": 2, "microbatch": 0, "traceback": "Traceback ...",
    }  # fmt: skip
    with ProgressView(8, enabled=False, log_dir=tmp_path) as view:
        view.update(membership(1, [0, 1], "start"))
        view.update(make(RecordKind.ERROR, 0.0, **error))
        view.show(LeaderLine(0, 1, "committed step 1"))
        view.show(LeaderLine(0, 2, "in step 2"))
        view.update(step_record(0, 1, 2))
        view.update(step_record(1, 1, 2))
        out, err = capsys.readouterr()
        assert out == "[worker 0] committed step 1\n" and err == ""  # the error waits for step 2's re-formation
        view.update(make(RecordKind.STOPPED, 0.0, reason="a bug"))
        out, err = capsys.readouterr()
        assert out == "[worker 0] in step 2\n" and "a bug" not in out + err
        assert err.startswith("worker 1 raised RuntimeError at train.py:3 in f, step 2, microbatch 0: bad\n")


# -- a real launch ----------------------------------------------------------------------------------------------
STEPS, KILL, WORKERS = 40, 3, 3
SCRIPT = f"""import time
import torch
from torch import nn
import unbroken.ft as ft

ctx = ft.init()
torch.manual_seed(0)
model = nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ctx.register_state(model, opt)
for step in ctx.steps():
    for mb in step.microbatches():
        g = ctx.generator(step.index, mb)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        step.backward(nn.functional.mse_loss(model(x), y), inputs=(x, y))
    step.commit(opt)
    if ctx.rank == 0 and step.index % 4 == 0:
        print(f"committed step {{step.index}}", flush=True)
    if step.index >= {KILL} and ctx.size < {WORKERS}:
        time.sleep(0.25)  # steps left for the restarted worker to rejoin at, however long its start takes
"""


@pytest.mark.timeout(240)
def test_a_launch_with_a_kill_and_a_rejoin_tells_its_story_in_order(tmp_path: Path) -> None:
    """Worker 1 killed in step 3's backward and restarted a second later (forked): the console says the failure, the
    death's epoch and the recovery of step 3 together, before the leader's lines of step 3 and after those of
    step 2; the rejoin's epoch with its rejoin line, after epoch 2's recovery; every step once, in order; every
    line the leader printed, once, tagged with its worker."""
    script = tmp_path / "story.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "unbroken", "launch", "--workers", str(WORKERS), "--out", str(out), "--fork"]
    kill = f"--failures.schedule=kill:worker=1,step={KILL},phase=backward,rejoin=1"
    cmd += [ONE_THREAD, f"--train.steps={STEPS}", "--train.microbatches=6", "--checkpoint.every=0", kill, str(script)]
    result = run_command(cmd, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout.splitlines()
    assert story_violations(console, STEPS) == [], result.stdout
    leader = [line for line in console if line.startswith("[")]
    assert leader == [f"[worker 0] committed step {s}" for s in range(0, STEPS, 4)], result.stdout
    recovered = read_records(out, "recovery")[0]
    assert (recovered["step"], recovered["epoch"]) == (KILL, 2)
    i = console.index("epoch 2: members [0, 2] (died: 1)")
    assert console[i - 1].startswith(f"worker 1 failed: kill:worker=1,step={KILL},phase=backward")
    assert console[i + 1].startswith(f"step {KILL} goes on with 2 workers (epoch 2)")
    joined = [r for r in read_records(out, "recovery") if r["from_epoch"] == 2]
    assert [(r["epoch"], r["alive"]) for r in joined] == [(3, 3)], result.stdout  # the script waited for it
    j = console.index("epoch 3: members [0, 1, 2] (joined: 1)")
    assert j > i + 1 and console[j + 1] == f"worker 1 rejoined at step {joined[0]['step']} (epoch 3, 3 alive)"
    assert any(line.startswith("steps ") for line in console)  # 2 steps a line: ranges were said
