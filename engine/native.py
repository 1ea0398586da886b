"""Builds and loads the project's C++ extension (``engine/csrc``), once, at first use.

``make install`` (and the Docker build) run ``python -m engine.native`` so a
server never compiles on its start-up path.  Every kernel in the extension
picks its instruction set per function (GCC ``target`` attributes) and is
dispatched at run time from the CPU's flags, so one build runs on any x86-64
host.  When the compiler or ninja is missing the engine runs on portable torch
code; ``CPUSERVE_NATIVE=0`` forces that.

A build also writes ``prebuilt.json`` beside the library: the hash of the sources,
flags and torch version it was built from.  While that record matches, the library is
imported directly, without torch's JIT loader, which needs a compiler and takes a lock
file in the build folder on every load: so a container runs with a read-only root
filesystem and an image without a compiler.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
from types import ModuleType
from typing import Iterator, Optional

from engine import envs

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_NAME = "cpuserve_C"
# Tuples, handed to torch as fresh lists: its JIT loader appends torch's own -L/-l flags to the
# ldflags list it is given, which would change the fingerprint between a build and its record.
_CFLAGS = ("-O3", "-fopenmp", "-std=c++17", "-Wno-unused-function")
_LDFLAGS = ("-fopenmp",)
_MANIFEST = "prebuilt.json"


def build_dir() -> str:
    return envs.CPUSERVE_BUILD_DIR or os.path.join(_REPO, "build", "native")


def _sources() -> list[str]:
    return sorted(glob.glob(os.path.join(_CSRC, "*.cpp")))


def source_fingerprint() -> str:
    """sha256 over every file in engine/csrc, the compiler flags and torch's version: what a
    prebuilt library must have been built from to be loaded as it is."""
    import torch

    digest = hashlib.sha256()
    for path in sorted(p for p in glob.glob(os.path.join(_CSRC, "**", "*"), recursive=True) if os.path.isfile(p)):
        digest.update(os.path.relpath(path, _CSRC).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(json.dumps([_CFLAGS, _LDFLAGS, torch.__version__]).encode())
    return digest.hexdigest()


def write_manifest(library: str) -> None:
    """Records that ``library`` (a path inside build_dir()) holds the current sources' build."""
    record = {"library": os.path.basename(library), "fingerprint": source_fingerprint()}
    tmp = os.path.join(build_dir(), _MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(build_dir(), _MANIFEST))


def load_prebuilt() -> Optional[ModuleType]:
    """The library a previous build recorded, imported without compiler, ninja or any write;
    None when there is no record, or it was built from other sources, flags or torch."""
    try:
        with open(os.path.join(build_dir(), _MANIFEST)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    library = os.path.join(build_dir(), os.path.basename(str(record.get("library", ""))))
    if record.get("fingerprint") != source_fingerprint() or not os.path.isfile(library):
        return None
    import torch  # noqa: F401 - the extension links against libtorch, loaded by this import

    loader = importlib.machinery.ExtensionFileLoader(_NAME, library)
    spec = importlib.util.spec_from_file_location(_NAME, library, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


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


_BF16_DOT_MODES = ("auto", "dpbf16", "fma")


def _configure(module: ModuleType) -> ModuleType:
    """Hands the extension the settings it takes from the environment, once, as it is loaded:
    the C++ code reads no environment variable itself.

    ``CPUSERVE_ATTN_BF16_DOT`` (auto | dpbf16 | fma): how vec512 attention multiplies a bf16
    model's values; ``CPUSERVE_ATTN_AMX_MIN_ROWS`` (int >= 1): the query rows from which an amx
    attention unit runs on tiles.  A value the extension cannot take is logged and ignored.
    """
    dot = envs.CPUSERVE_ATTN_BF16_DOT.lower()
    if dot and hasattr(module, "attention_set_bf16_dot"):
        if dot in _BF16_DOT_MODES:
            module.attention_set_bf16_dot(dot)
        else:
            logger.warning("ignoring CPUSERVE_ATTN_BF16_DOT=%r: expected one of %s", dot, ", ".join(_BF16_DOT_MODES))
    if hasattr(module, "attention_set_amx_min_rows"):
        try:
            module.attention_set_amx_min_rows(envs.CPUSERVE_ATTN_AMX_MIN_ROWS)
        except ValueError:
            logger.warning("ignoring CPUSERVE_ATTN_AMX_MIN_ROWS=%r: expected an integer",
                           envs.flag_env_value("--attn-amx-min-rows"))
    return module


@functools.lru_cache(maxsize=1)
def load(verbose: bool = False) -> Optional[ModuleType]:
    """The compiled extension (configured from the environment, see _configure), or None (with
    one warning) when it cannot be built here."""
    if not envs.CPUSERVE_NATIVE:
        return None
    sources = _sources()
    if not sources:
        return None
    try:
        prebuilt = load_prebuilt()
        if prebuilt is not None:
            return _configure(prebuilt)
        from torch.utils import cpp_extension

        os.makedirs(build_dir(), exist_ok=True)
        with _build_lock(), _own_ninja():
            module = cpp_extension.load(
                name=_NAME,
                sources=sources,
                build_directory=build_dir(),
                extra_cflags=list(_CFLAGS),
                extra_ldflags=list(_LDFLAGS),
                extra_include_paths=[_CSRC],
                verbose=verbose,
            )
            try:
                write_manifest(module.__file__)
            except OSError as exc:  # still usable now; the next start-up goes through torch again
                logger.warning("could not record the native build in %s: %s", build_dir(), exc)
            return _configure(module)
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
