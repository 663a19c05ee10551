"""The layering: dependencies point one way, read from the source with ``ast``.

Floors (lowest first): ``speccal.base`` imports nothing of ours; ``costmodel`` and ``kernels``
sit on it; the torch-free policy floor (``speccal.policy*``, ``replay``, ``replay_run``, ``trace``,
``scenarios``, ``plots_*``) on ``costmodel``; ``speccal.interop`` (engine interop) on the
policy floor; ``runner`` on ``kernels``; ``calibrate`` on ``runner`` and ``costmodel``;
``speccal.live`` on ``runner`` and the policy floor; ``speccal.cli`` on everything, and nothing
imports it. The source folders are installed as ``speccal.*`` and
nothing may import them bare.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {
    "speccal": "speccal",
    "calibrate": "speccal.calibrate",
    "costmodel": "speccal.costmodel",
    "runner": "speccal.runner",
    "kernels": "speccal.kernels",
}
BARE = ("runner", "kernels", "calibrate", "costmodel")
POLICY_FLOOR = (
    "policy", "policy_rules", "replay", "replay_run", "trace", "scenarios", "plots_replay",
    "plots_table",
)

#: What each unit may import of ours (``speccal`` itself, the version, is open to everyone).
ALLOWED = {
    "base": {"base"},
    "costmodel": {"base", "costmodel"},
    "kernels": {"base", "kernels"},
    "policy": {"base", "costmodel", "policy"},
    "runner": {"base", "kernels", "runner"},
    "calibrate": {"base", "costmodel", "runner", "calibrate"},
    "live": {"base", "costmodel", "policy", "runner", "live"},
    "interop": {"base", "costmodel", "policy", "interop"},
    "cli": {
        "base", "costmodel", "policy", "runner", "kernels", "calibrate", "live", "interop", "cli"
    },
    "root": {"cli"},  # speccal/__main__.py: the console entry
}
TORCH_FREE = ("base", "costmodel", "policy", "interop")
#: Units whose import pulls torch in; the CLI imports them inside its commands only.
NEEDS_TORCH = ("runner", "kernels", "calibrate", "live")
TORCH_PACKAGES = ("torch", "triton", "torch_npu", "transformers")


def _unit(module: str) -> str | None:
    """The floor a ``speccal.*`` module belongs to (None: the bare ``speccal`` package)."""
    parts = module.split(".")
    if parts[0] != "speccal":
        return None
    if len(parts) == 1:
        return None
    head = parts[1]
    if head in POLICY_FLOOR:
        return "policy"
    if head in ("__main__",):
        return "root"
    return head


def _modules():
    """``(module name, path, tree)`` of every source module."""
    out = []
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            if folder == "speccal" and rel.parts[0] in SOURCES:
                continue
            name = ".".join((package, *rel.parts)).removesuffix(".__init__")
            out.append((name, path, ast.parse(path.read_text(), filename=str(path))))
    return out


MODULES = _modules()


def _imports(tree: ast.AST):
    """``(imported module, line, at module level)`` of every absolute import in ``tree``."""
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            yield name, node.lineno, id(node) in top


def _violations(check) -> list[str]:
    bad = []
    for name, path, tree in MODULES:
        for target, line, top in _imports(tree):
            why = check(name, _unit(name), target, top)
            if why:
                bad.append(f"{path.relative_to(ROOT)}:{line} {name} imports {target}: {why}")
    return bad


def test_the_ast_scan_sees_every_floor():
    units = {_unit(name) for name, _, _ in MODULES}
    assert set(ALLOWED) <= units, units
    assert len(MODULES) > 60


def test_dependencies_point_one_way():
    def check(name, unit, target, top):
        dst = _unit(target)
        if dst is None or unit is None or dst in ALLOWED[unit]:
            return None
        return f"{unit} may import only {sorted(ALLOWED[unit])}"

    assert _violations(check) == []


def test_nothing_imports_the_cli():
    def check(name, unit, target, top):
        if _unit(target) == "cli" and unit not in ("cli", "root"):
            return "nothing imports speccal.cli"
        return None

    assert _violations(check) == []


def test_torch_free_floors_never_import_torch():
    """Not even inside a function: costmodel, the policies and replay run in a torch-free notebook."""

    def check(name, unit, target, top):
        if unit in TORCH_FREE and target.split(".")[0] in TORCH_PACKAGES:
            return f"{unit} stays torch-free"
        return None

    assert _violations(check) == []


def test_the_cli_imports_the_runner_only_inside_its_commands():
    """So that ``speccal --help`` and the torch-free commands run without torch."""

    def check(name, unit, target, top):
        torchy = _unit(target) in NEEDS_TORCH or target.split(".")[0] in TORCH_PACKAGES
        if unit == "cli" and top and torchy:
            return "the CLI must start without torch: import it inside the command"
        return None

    assert _violations(check) == []


def test_the_cli_imports_lazily_only_what_needs_torch():
    """Module-level imports show the graph; a command imports inside its body only the floors
    (and packages) that bring torch in."""

    def check(name, unit, target, top):
        torchy = _unit(target) in NEEDS_TORCH or target.split(".")[0] in TORCH_PACKAGES
        if unit == "cli" and not top and not torchy:
            return "torch-free: import at module level"
        return None

    assert _violations(check) == []


@pytest.mark.parametrize("unit", ["base", "policy", "live", "interop"])
def test_no_function_level_imports_in_the_floors_that_need_none(unit):
    """Module-level imports show the graph; these floors have no torch to keep out."""

    def check(name, u, target, top):
        return "import at module level" if u == unit and not top else None

    assert _violations(check) == []


def test_no_bare_top_level_module_is_imported():
    def check(name, unit, target, top):
        return "import speccal.<package>, never the bare folder" if target.split(".")[0] in BARE else None

    assert _violations(check) == []


def test_imported_modules_no_bare_folder_and_no_torch_in_the_torch_free_floors():
    """What really gets imported (one subprocess): the torch-free floors and the CLI itself pull
    in no torch; the whole tree pulls in no bare source folder."""
    code = (
        "import sys, speccal.costmodel, speccal.base, speccal.policy, speccal.policy_rules, "
        "speccal.replay, speccal.trace, speccal.scenarios, speccal.plots_replay, "
        "speccal.plots_table, speccal.replay_run, speccal.interop.export, speccal.cli\n"
        "print('torch' in sys.modules)\n"
        "import speccal.runner.engine, speccal.kernels.ops, speccal.calibrate.pipeline, "
        "speccal.live.bench\n"
        f"print(','.join(m for m in sys.modules if m.split('.')[0] in {BARE!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    torch_loaded, bare = (out.stdout.splitlines() + [""])[:2]
    assert torch_loaded == "False"
    assert bare == "", f"bare top-level modules imported: {bare}"


def test_version_flag():
    out = subprocess.run(
        [sys.executable, "-m", "speccal", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("speccal ")
