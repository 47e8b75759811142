"""The package's layers hold, read from its imports: core <- data, sim, control <- ft <- train, integrations <- lab
<- cli (and ``python -m unbroken`` above all); a package in no layer fails until it is placed. No module imports a
package of a higher layer, at its top or inside a function, absolutely or relatively; and no string of a module
(its docstrings aside) names a module path of a higher layer (``python -m unbroken.train`` in the control plane, a
preload list, ``importlib.import_module("unbroken.ft...")``): a part that runs a program of a higher layer is handed
it by its caller. Imports between the peers of one layer (data, sim, control; train, integrations) are not judged.

The checker reads source text only (``ast``): it imports nothing, so it also judges modules that cannot be imported
here, and it is shown to fire on doctored sources and on a doctored package on disk.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent
# integrations/ (torchtitan on unbroken) is a trainer built on the library, as train/ is: the same layer.
LAYERS = {
    **{"core": 0, "data": 1, "sim": 1, "control": 1, "ft": 2, "train": 3, "integrations": 3},
    **{"lab": 4, "cli": 5, "__main__": 6},
}
ROOT_MODULE = "__init__"  # unbroken/__init__.py: what ``import unbroken.anything`` runs first, so the lowest layer
_MODULE_PATH = re.compile(r"\bunbroken\.(\w+)")


def layer_of(rel: str) -> tuple[str, int] | None:
    """The package of module ``rel`` (``unbroken/control/launcher.py`` -> control) and its layer; None for a module
    in no known layer."""
    parts = PurePosixPath(rel).parts
    name = parts[1][:-3] if parts[1].endswith(".py") else parts[1]
    if name == ROOT_MODULE:
        return name, 0
    return (name, LAYERS[name]) if name in LAYERS else None


def _imported(rel: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement of module ``rel`` reaches (relative ones made absolute; ``from unbroken
    import train`` reaches ``unbroken.train``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = list(PurePosixPath(rel).with_suffix("").parts)[:-1]  # a module's package, or a package's own
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring nodes of the module and of its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def layer_problems(rel: str, source: str) -> list[tuple[str, str]]:
    """(module, what) for each upward edge of module ``rel`` (its path under the repository) whose text is
    ``source``: ``imports unbroken.X...`` or ``names 'unbroken.X...' in a string``, X of a higher layer."""
    mine = layer_of(rel)
    if mine is None:
        return [(rel, "is in no layer (add its package to LAYERS)")]
    _, level = mine
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    problems: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for name in _imported(rel, node):
                bits = name.split(".")
                if len(bits) >= 2 and bits[0] == "unbroken" and LAYERS.get(bits[1], -1) > level:
                    problems.append((rel, f"imports {name}"))
                    break
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            for found in _MODULE_PATH.finditer(node.value):
                if LAYERS.get(found.group(1), -1) > level:
                    problems.append((rel, f"names {node.value[:60]!r} in a string"))
                    break
    return problems


def tree_problems(root: Path) -> list[tuple[str, str]]:
    """Every upward edge of the package under ``root`` (``root/unbroken``)."""
    problems = []
    for path in sorted((root / "unbroken").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        problems += layer_problems(rel, path.read_text())
    return problems


def test_no_module_reaches_up_a_layer() -> None:
    problems = "\n".join(f"{rel} {what}" for rel, what in tree_problems(ROOT))
    assert not problems, f"upward edges (core <- data, sim, control <- ft <- train <- lab <- cli):\n{problems}"


@pytest.mark.parametrize(
    ("rel", "source", "what"),
    [
        ("unbroken/control/agent.py", "from unbroken.train.hf import WORKER_IMPORTS\n", "imports unbroken.train.hf"),
        ("unbroken/control/launcher.py", "import unbroken.ft.stops\n", "imports unbroken.ft.stops"),
        ("unbroken/ft/api.py", "def f():\n    from unbroken import lab\n", "imports unbroken.lab"),
        ("unbroken/ft/parallel/tensor.py", "from ...train import stages\n", "imports unbroken.train"),
        ("unbroken/control/host/zygote.py", "from ... import ft\n", "imports unbroken.ft"),
        ("unbroken/core/plan.py", "from unbroken.sim.engine import Engine\n", "imports unbroken.sim.engine"),
        ("unbroken/lab/report.py", "from unbroken.cli import main\n", "imports unbroken.cli"),
        ("unbroken/cli.py", "import unbroken.__main__\n", "imports unbroken.__main__"),
        (
            "unbroken/control/launcher.py",
            'import sys\nTRAINER = (sys.executable, "-m", "unbroken.train")\n',
            "names 'unbroken.train' in a string",
        ),
        (
            "unbroken/control/host/zygote.py",
            'def warm(cfg):\n    return f"--preload=unbroken.ft.foldkernel:warm {cfg}"\n',
            "names '--preload=unbroken.ft.foldkernel:warm ' in a string",
        ),
        (
            "unbroken/train/trainer.py",
            'import importlib\nimportlib.import_module("unbroken.lab.bench")\n',
            "names 'unbroken.lab.bench' in a string",
        ),
        ("unbroken/newpackage/thing.py", "x = 1\n", "is in no layer (add its package to LAYERS)"),
    ],
)
def test_the_layer_check_fires_on_an_upward_edge(rel: str, source: str, what: str) -> None:
    """Doctored sources: each holds one upward edge, which the check names."""
    assert layer_problems(rel, source) == [(rel, what)]


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        ("unbroken/control/host/agent.py", '"""Runs what its caller gives it (``python -m unbroken.train``)."""\n'),
        ("unbroken/control/host/zygote.py", 'def f():\n    """The zygote imports ``unbroken.ft.foldkernel``."""\n'),
        ("unbroken/control/launcher.py", "from unbroken.core.config import RunConfig\nfrom unbroken.data import x\n"),
        ("unbroken/data/prepare.py", "from unbroken.control.store import keys\n"),  # peers of one layer
        ("unbroken/train/launch.py", 'FOLD = "unbroken.ft.foldkernel:warm"\nimport unbroken.ft\n'),
        ("unbroken/cli.py", 'from unbroken.lab import chaos\nRUN = "python -m unbroken.lab.faultdriver"\n'),
        ("unbroken/__main__.py", "from unbroken.cli import run\n"),
        ("unbroken/control/coordinator/loop.py", 'CMD = ("-m", "unbroken", "coordinator")\n'),
    ],
)
def test_the_layer_check_passes_what_keeps_the_layers(rel: str, source: str) -> None:
    """Docstrings may name any module; imports and strings of the same or a lower layer, and of a peer, are fine."""
    assert layer_problems(rel, source) == []


def test_the_layer_check_finds_a_new_edge_in_a_package_on_disk(tmp_path: Path) -> None:
    """A copy of the layering in a package of its own, with two upward imports and one command line: the walk over
    the tree reports the three, and only them."""
    files = {
        "unbroken/__init__.py": '"""The root."""\n',
        "unbroken/core/exits.py": "EXIT_STOPPED = 3\n",
        "unbroken/control/host/agent.py": "from unbroken.core.exits import EXIT_STOPPED\n",
        "unbroken/control/launcher.py": 'COMMAND = ("python", "-m", "unbroken.train")\n',
        "unbroken/ft/parallel/tensor.py": "from unbroken.train.model import Transformer\nfrom unbroken.lab import x\n",
        "unbroken/train/launch.py": 'import unbroken.control.host.agent\nPRELOAD = ("unbroken.train.trainer",)\n',
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    problems = tree_problems(tmp_path)
    assert problems == [
        ("unbroken/control/launcher.py", "names 'unbroken.train' in a string"),
        ("unbroken/ft/parallel/tensor.py", "imports unbroken.train.model"),
        ("unbroken/ft/parallel/tensor.py", "imports unbroken.lab"),
    ]
