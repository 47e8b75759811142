"""The shell commands the documentation shows: extracted from the ```sh fenced blocks of README.md and docs/*.md
(tests/test_docs_commands.py decides how each is checked).

A block holds commands one after another. A command continues over lines ending in ``\\``, over a quoted
string left open (``python -c "...`` on several lines) and over a here-document's body; comment lines and blank
lines between commands are dropped. ``DocCommand.text`` is the command exactly as written (what bash runs),
``words`` its shell words (comments dropped, continuations joined), ``key`` the words with the program named one
way however it is invoked (``unbroken train ...`` for ``unbroken train``, ``python -m unbroken train`` and
``.venv/bin/python -m unbroken train``), which the rules match.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

SHELL_FENCES = ("sh", "bash", "shell")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_]\w*)\1")
PYTHONS = ("python", "python3", ".venv/bin/python", ".venv/bin/python3")
# The first word of a line that is a command (for unfenced blocks: see ``unfenced_commands``).
PROGRAMS = {"unbroken", "python", "python3", "make", "pip", "torchrun", "sbatch", "time", "export", "git"}


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


@dataclass(frozen=True)
class DocCommand:
    """One command of a documentation page."""

    path: str  # relative to the repository root
    line: int  # of its first line, from 1
    text: str  # as written, over its lines
    words: tuple[str, ...]  # its shell words: comments dropped, continuations joined (a here-document's first line)

    @property
    def source(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def env(self) -> dict[str, str]:
        """The ``NAME=value`` assignments before the program."""
        return dict(w.split("=", 1) for w in self.words[: self._assignments()])

    def _assignments(self) -> int:
        """How many ``NAME=value`` words open the command."""
        i = 0
        while i < len(self.words) and ASSIGNMENT.match(self.words[i]):
            i += 1
        return i

    def _program_index(self) -> int:
        i = self._assignments()
        return i + 1 if self.words[i : i + 1] == ("time",) else i

    def cli_index(self) -> int | None:
        """The index in ``words`` of the ``unbroken`` CLI's command (``train`` in ``python -m unbroken train``), None
        when the command does not run the CLI (``torchrun ... -m unbroken agent`` does)."""
        words = self.words
        start = self._program_index()
        if words[start : start + 1] in (("unbroken",), (".venv/bin/unbroken",)):
            return start + 1
        for i in range(start, len(words) - 1):
            if words[i : i + 2] == ("-m", "unbroken"):
                return i + 2
        return None

    def cli_argv(self) -> list[str] | None:
        """The arguments given to the ``unbroken`` CLI, None when the command does not run it."""
        i = self.cli_index()
        return None if i is None else list(self.words[i:])

    def module_argv(self) -> tuple[str, list[str]] | None:
        """``(module, arguments)`` of a command that runs a module of the package other than the CLI (``python -m
        unbroken.lab.bench_mecefo ARGS``); None for any other command."""
        words = self.words[self._program_index() :]
        if words[:1] and words[0] in PYTHONS and words[1:2] == ("-m",) and len(words) > 2:
            if words[2].startswith("unbroken.") and self.cli_index() is None:
                return words[2], list(words[3:])
        return None

    @property
    def key(self) -> str:
        """The command as the rules see it: ``unbroken ARGS`` when the program is the CLI, ``python ARGS`` for any
        Python; no environment assignments, no ``time``."""
        start = self._program_index()
        rest = list(self.words[start:])
        if rest and rest[0] in PYTHONS:
            rest[0] = "python"
        if rest[:3] == ["python", "-m", "unbroken"] or rest[:1] == [".venv/bin/unbroken"]:
            rest = ["unbroken", *rest[3 if rest[0] == "python" else 1 :]]
        return " ".join(rest)

    def outputs(self) -> set[str]:
        """What the command writes by name: the argument of ``--out``, ``unbroken export``'s OUT, a ``>`` redirect."""
        words, found = self.words, set()
        for i, w in enumerate(words[:-1]):
            if w in ("--out", ">"):
                found.add(words[i + 1].rstrip("/"))
        argv = self.cli_argv()
        if argv and argv[0] == "export" and len(argv) >= 3:
            found.add(argv[2].rstrip("/"))
        return found

    def replaced(self, written: str, value: str) -> DocCommand:
        """The command with the word(s) ``written`` (not followed by more of a word) replaced by ``value``."""
        text = re.sub(re.escape(written) + r"(?![\w.])", lambda _: value, self.text)
        return self if text == self.text else DocCommand(self.path, self.line, text, words_of(text))


def shell_words(text: str) -> list[str]:
    """``text``'s shell words (comments dropped, ``\\`` continuations joined); ValueError while a quote is open."""
    return shlex.split(text.replace("\\\n", " "), comments=True)


def words_of(text: str) -> tuple[str, ...]:
    """A whole command's shell words: those of its first line when it starts a here-document."""
    first = text.split("\n", 1)[0]
    try:
        words = shell_words(first)
    except ValueError:
        return tuple(shell_words(text))
    return tuple(words) if HEREDOC.search(" ".join(words)) else tuple(shell_words(text))


def blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """The fenced blocks of a markdown file: (language, line of the first content line, lines), indentation removed."""
    found: list[tuple[str, int, list[str]]] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        found.append((lang, i + 2, body))
        i = j + 1
    return found


def commands_of_block(path: str, first_line: int, lines: list[str]) -> list[DocCommand]:
    """The block's commands, in order; ValueError for a command that never ends (a quote or here-document left
    open at the end of the block)."""
    commands: list[DocCommand] = []
    pending: list[str] = []
    start = 0
    heredoc = ""
    for n, line in enumerate(lines):
        if heredoc:
            pending.append(line)
            if line.strip() == heredoc:
                commands.append(
                    DocCommand(path, first_line + start, "\n".join(pending), tuple(shell_words(pending[0])))
                )
                pending, heredoc = [], ""
            continue
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            start = n
        pending.append(line)
        text = "\n".join(pending)
        if text.rstrip().endswith("\\"):
            continue
        try:
            words = shell_words(text)
        except ValueError:
            continue  # a quote still open: the command goes on
        doc = HEREDOC.search(" ".join(words))
        if doc and len(pending) == 1:
            heredoc = doc.group(2)
            continue
        commands.append(DocCommand(path, first_line + start, text, tuple(words)))
        pending = []
    if pending:
        raise ValueError(f"{path}:{first_line + start}: the command never ends (an open quote or here-document)")
    return commands


def extract(root: Path) -> tuple[list[DocCommand], list[str]]:
    """Every command of README.md and docs/*.md, and the problems found (commands that never end)."""
    commands: list[DocCommand] = []
    problems: list[str] = []
    for file in doc_files(root):
        rel = str(file.relative_to(root))
        for lang, line, body in blocks(file):
            if lang in SHELL_FENCES:
                try:
                    commands += commands_of_block(rel, line, body)
                except ValueError as e:
                    problems.append(str(e))
    return commands, problems


def unfenced_commands(root: Path) -> list[str]:
    """``path:line: text`` of each line that reads as a command in a block not fenced as a shell block (a command
    there would escape the test)."""
    found = []
    for file in doc_files(root):
        rel = str(file.relative_to(root))
        for lang, line, body in blocks(file):
            if lang in SHELL_FENCES or lang in ("python", "toml", "json", "yaml"):
                continue
            for n, text in enumerate(body):
                words = text.split()
                first = next((w for w in words if not ASSIGNMENT.match(w)), "")
                if first in PROGRAMS or first.startswith((".venv/bin/", "scripts/")):
                    found.append(f"{rel}:{line + n}: {text.strip()}")
    return found
