"""The core library stands alone: importing it (and its public pieces) loads neither megatron nor the
applications' extras, so a DeepEP user's `import uccl_ep_train` costs what the library needs; and no
library module (uccl_ep_train outside uccl_ep_train.apps) imports the applications or megatron_patch."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

APPLICATION_ONLY = ("megatron", "megatron_patch", "matplotlib", "transformer_engine")


def test_importing_the_library_loads_no_megatron():
    code = ("import sys, uccl_ep_train\n"
            "from uccl_ep_train import Buffer, Config, EventOverlap, autograd, permute, validation\n"
            "from uccl_ep_train.compat import deep_ep, primus_turbo\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {APPLICATION_ONLY!r}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing the library loaded: {done.stdout.strip()}"


ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "uccl_ep_train"
APPLICATIONS = ("uccl_ep_train.apps", "megatron_patch")


def _library_files() -> list[Path]:
    return sorted(p for p in LIBRARY.rglob("*.py") if (LIBRARY / "apps") not in p.parents)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in `path`, function-local ones included."""
    package = _module_name(path).split(".") if path.name == "__init__.py" else _module_name(path).split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found += [(node.lineno, f"{module}.{alias.name}" if module else alias.name) for alias in node.names]
    return found


def _is_application(name: str) -> bool:
    return any(name == app or name.startswith(app + ".") for app in APPLICATIONS)


def test_no_library_module_imports_the_applications():
    """The import direction reads one way: apps -> megatron_patch -> library. Every import statement of the
    library's source (lazy ones inside functions too) stays out of uccl_ep_train.apps and megatron_patch."""
    offenders = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in _library_files()
                 for line, name in _imported(path) if _is_application(name)]
    assert not offenders, "the library imports an application:\n" + "\n".join(offenders)


def test_importing_every_library_module_loads_no_application():
    """Each library module imported in turn (one fresh interpreter): the first whose import brings an
    application module or megatron into sys.modules is named."""
    names = [_module_name(p) for p in _library_files()]
    code = ("import importlib, json, sys\n"
            f"apps = {(*APPLICATIONS, 'megatron')!r}\n"
            "def loaded():\n"
            "    return sorted(m for m in sys.modules if any(m == a or m.startswith(a + '.') for a in apps))\n"
            "offenders = {}\n"
            f"for name in {names!r}:\n"
            "    before = set(loaded())\n"
            "    importlib.import_module(name)\n"
            "    new = sorted(set(loaded()) - before)\n"
            "    if new:\n"
            "        offenders[name] = new\n"
            "print(json.dumps(offenders))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    offenders = json.loads(done.stdout.strip().splitlines()[-1])
    assert not offenders, "importing these library modules loaded applications: " + ", ".join(
        f"{name} -> {', '.join(mods)}" for name, mods in offenders.items())
