"""Builds and loads the project's C++ extension (``engine/csrc``), once, at first use.

``make install`` (and the Docker build) run ``python -m engine.native`` so a
server never compiles on its start-up path.  Every kernel in the extension
picks its instruction set per function (GCC ``target`` attributes) and is
dispatched at run time from the CPU's flags, so one build runs on any x86-64
host.  When the compiler or ninja is missing the engine runs on portable torch
code; ``CPUSERVE_NATIVE=0`` forces that.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import logging
import os
import sys
from types import ModuleType
from typing import Iterator, Optional

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_dir() -> str:
    return os.environ.get("CPUSERVE_BUILD_DIR") or os.path.join(_REPO, "build", "native")


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    """One process at a time checks or builds the extension, under a lock the kernel drops if
    its holder dies.

    torch's own lock is a plain file that a process killed mid-build leaves behind, and every
    later start-up then waits on it forever, silently.  Holding this lock, any such file is
    stale: it is removed.
    """
    with open(os.path.join(build_dir(), ".cpuserve-build.lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is building the native kernels in %s", build_dir())
            fcntl.flock(f, fcntl.LOCK_EX)
        stale = os.path.join(build_dir(), "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by a native build that was interrupted", stale)
            os.remove(stale)
        yield


@contextlib.contextmanager
def _own_ninja() -> Iterator[None]:
    """Build with the ninja installed next to this Python (requirements.txt pins it).

    torch runs whichever ``ninja`` comes first on PATH; a system ninja of another version
    reads the venv one's build log as foreign and rebuilds everything (~1 min on 2 cores),
    so a server started without the venv on PATH recompiled at every start.
    """
    venv_bin = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if not os.access(os.path.join(venv_bin, "ninja"), os.X_OK) or path.split(os.pathsep)[0] == venv_bin:
        yield
        return
    os.environ["PATH"] = venv_bin + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


@functools.lru_cache(maxsize=1)
def load(verbose: bool = False) -> Optional[ModuleType]:
    """The compiled extension, or None (with one warning) when it cannot be built here."""
    if os.environ.get("CPUSERVE_NATIVE", "1") == "0":
        return None
    sources = sorted(glob.glob(os.path.join(_CSRC, "*.cpp")))
    if not sources:
        return None
    try:
        from torch.utils import cpp_extension

        os.makedirs(build_dir(), exist_ok=True)
        with _build_lock(), _own_ninja():
            return cpp_extension.load(
                name="cpuserve_C",
                sources=sources,
                build_directory=build_dir(),
                extra_cflags=["-O3", "-fopenmp", "-std=c++17", "-Wno-unused-function"],
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[_CSRC],
                verbose=verbose,
            )
    except Exception as exc:  # noqa: BLE001 - any build failure means: run the portable path
        logger.warning("native kernels unavailable, using portable torch kernels: %s", str(exc).splitlines()[0])
        return None


@functools.lru_cache(maxsize=None)
def module_with(name: str) -> Optional[ModuleType]:
    """The extension when it has ``name`` (built on first use), else None: each group of
    kernels asks for one of its own functions, so a stale or partial build disables only
    the groups it lacks."""
    mod = load()
    return mod if mod is not None and hasattr(mod, name) else None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    mod = load(verbose="-v" in sys.argv)
    print("native extension:", "built" if mod is not None else "unavailable", build_dir())
    sys.exit(0 if mod is not None or "--optional" in sys.argv else 1)
