"""`uccl-ep-train install-deep-ep`: install our `deep_ep` as a distribution named `deep_ep`.

Why: with `USING_UEP=1`, primus-cli's hook `runner/helpers/hooks/05_using_uep.sh` (AMD-AGI/Primus) stops the
launch unless `python3 -m pip show uccl` and `python3 -m pip show deep_ep` both find a distribution, then
exports PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=DEEP_EP, so Primus-Turbo's dispatch/combine run on whatever
`import deep_ep` finds; primus-cli's `runner/helpers/envs/base_env.sh` puts site-packages ahead of
PYTHONPATH, so only an installed `deep_ep` is found first there. An installed `deep_ep` distribution that is
ours passes the hook's second check and is what Primus-Turbo imports.

What gets installed: a wheel built here, offline, whose one module `deep_ep/__init__.py` makes `deep_ep`,
`deep_ep.buffer` and `deep_ep.utils` the modules of uccl_ep_train.compat.deep_ep (`install_deep_ep()`), so
the code is always that of the uccl-ep-train installed beside it. Its version carries the local label
`+uccl.ep.train` and its summary says whose it is. pip replaces the `deep_ep` distribution installed before
(in Primus's images: UCCL's deep_ep wrapper, `deep_ep 0.1.0`); `--uninstall` removes ours, and only ours.

Not provided: the hook's first check wants UCCL's own `uccl` distribution (uccl-project/uccl), which
uccl-ep-train neither is nor ships; Primus's images have it installed. Without it the hook refuses to start
and the route to ours under primus-cli is `--env PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=UCCL_EP`
(docs/recipes.md).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import Optional

from uccl_ep_train import __version__

from . import SHIM_MARK

DIST_NAME = "deep_ep"
LOCAL_LABEL = "uccl.ep.train"
VERSION = f"{__version__}+{LOCAL_LABEL}"
SUMMARY = "DeepEP's Python API served by uccl-ep-train (not DeepEP, not UCCL's deep_ep wrapper)"
BACKEND_INSTEAD = "--env PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=UCCL_EP"

SHIM = f'''"""`deep_ep`, served by uccl-ep-train (not DeepEP, not UCCL's deep_ep wrapper).

Installed by `uccl-ep-train install-deep-ep`: `deep_ep`, `deep_ep.buffer` and `deep_ep.utils` are the modules
of uccl_ep_train.compat.deep_ep, those of the uccl-ep-train installed beside this file.
`uccl-ep-train install-deep-ep --uninstall` removes it.
"""
{SHIM_MARK} = True

from uccl_ep_train.compat import install_deep_ep as _install

_install()  # puts uccl_ep_train.compat.deep_ep in sys.modules in place of this module
'''


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(out_dir: str, name: str = DIST_NAME, version: str = VERSION, files: Optional[dict] = None,
                summary: str = SUMMARY, requires: tuple = ("uccl-ep-train",)) -> str:
    """Write a pure-Python wheel holding `files` ({path in the wheel: text}; default: our deep_ep shim) and
    return its path."""
    files = {"deep_ep/__init__.py": SHIM} if files is None else files
    dist_info = f"{name}-{version}.dist-info"
    top = sorted({p.split("/")[0] for p in files})
    meta = {
        f"{dist_info}/METADATA": "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                          f"Summary: {summary}\n"] + [f"Requires-Dist: {r}\n" for r in requires]),
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: uccl-ep-train\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist_info}/top_level.txt": "".join(t + "\n" for t in top),
    }
    entries = {path: text.encode() for path, text in {**files, **meta}.items()}
    record = "".join(f"{p},{_record_hash(b)},{len(b)}\n" for p, b in entries.items()) + f"{dist_info}/RECORD,,\n"
    entries[f"{dist_info}/RECORD"] = record.encode()
    path = os.path.join(out_dir, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for p, b in entries.items():
            whl.writestr(p, b)
    return path


def pip_show(python: str, name: str) -> Optional[dict]:
    """`python -m pip show name` as a dict (Name, Version, Summary, Location, ...); None when not installed."""
    r = subprocess.run([python, "-m", "pip", "show", name], capture_output=True, text=True)
    if r.returncode:
        return None
    return dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)


def is_ours(shown: Optional[dict]) -> bool:
    return bool(shown) and shown.get("Version", "").endswith("+" + LOCAL_LABEL)


def _pip(python: str, *args: str) -> int:
    return subprocess.run([python, "-m", "pip", *args, "--disable-pip-version-check"]).returncode


_VERIFY = ("import deep_ep, uccl_ep_train; assert deep_ep.Buffer is uccl_ep_train.Buffer, deep_ep.__file__; "
           "print(deep_ep.__file__)")


def install(python: str = sys.executable) -> int:
    before = pip_show(python, DIST_NAME)
    with tempfile.TemporaryDirectory() as tmp:
        rc = _pip(python, "install", "--no-deps", "--no-index", "--force-reinstall", write_wheel(tmp))
    if rc:
        print(f"uccl-ep-train install-deep-ep: pip failed (exit status {rc})", file=sys.stderr)
        return rc
    if before and not is_ours(before):
        print(f"replaced {before.get('Name')} {before.get('Version')} ({before.get('Summary', '')}); to have it "
              "back: `uccl-ep-train install-deep-ep --uninstall`, then reinstall it (UCCL's wrapper: `pip install .` "
              "in uccl/ep/deep_ep_wrapper)")
    check = subprocess.run([python, "-c", _VERIFY], capture_output=True, text=True)
    if check.returncode:
        print(f"installed {DIST_NAME} {VERSION}, but `import deep_ep` in {python} does not give uccl-ep-train's "
              f"Buffer (is uccl-ep-train installed in that environment?):\n{check.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"installed {DIST_NAME} {VERSION} for {python}: `import deep_ep` is uccl-ep-train "
          f"({check.stdout.strip().splitlines()[-1]})")
    uccl = pip_show(python, "uccl")
    if uccl is None:
        print("note: primus-cli's USING_UEP=1 hook (05_using_uep.sh) also requires UCCL's own `uccl` distribution "
              "(`pip show uccl`), which uccl-ep-train does not provide; Primus's images have it. Without it, run "
              f"Primus-Turbo's DeepEP dispatcher on uccl-ep-train with `primus-cli direct {BACKEND_INSTEAD} ...` "
              "instead of USING_UEP=1 (docs/recipes.md)", file=sys.stderr)
    else:
        print(f"`pip show uccl` finds uccl {uccl.get('Version')}: primus-cli's USING_UEP=1 hook passes. Do not set "
              "REBUILD_UEP=1 with it: that hook reinstalls UCCL's deep_ep wrapper over this one at every launch")
    return 0


def uninstall(python: str = sys.executable) -> int:
    shown = pip_show(python, DIST_NAME)
    if shown is None:
        print(f"no {DIST_NAME} distribution is installed for {python}")
        return 0
    if not is_ours(shown):
        print(f"uccl-ep-train install-deep-ep: the installed {DIST_NAME} {shown.get('Version')} is not ours "
              f"({shown.get('Summary', '')}); leaving it", file=sys.stderr)
        return 1
    return _pip(python, "uninstall", "--yes", DIST_NAME)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="uccl-ep-train install-deep-ep", description=__doc__.split("\n\n")[0],
                                epilog="docs/recipes.md, 'Primus-Turbo's DeepEP dispatcher on UCCL-EP'")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter whose environment gets it (default: this one; under primus-cli, the "
                        "`python3` its hooks run)")
    p.add_argument("--uninstall", action="store_true", help="remove our deep_ep distribution (only ours)")
    p.add_argument("--wheel-dir", metavar="DIR", help="only write the wheel into DIR (to install it elsewhere "
                                                       "with `pip install --no-deps`), print its path")
    ns = p.parse_args(argv)
    if ns.wheel_dir:
        os.makedirs(ns.wheel_dir, exist_ok=True)
        print(write_wheel(ns.wheel_dir))
        return 0
    return uninstall(ns.python) if ns.uninstall else install(ns.python)


if __name__ == "__main__":
    sys.exit(main())
