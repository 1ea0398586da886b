"""engine/native.py loads a recorded build without torch's JIT loader: no compiler, no writes.

That is what lets the Kubernetes Deployment run with ``readOnlyRootFilesystem: true`` and the
image's runtime stage carry no compiler.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import native

from .helpers import ROOT

# Run in a fresh interpreter: torch's JIT loader is replaced by one that fails, and PATH holds
# no compiler or ninja, so only the direct import can succeed.
PROBE = """
import torch.utils.cpp_extension as ce
def no_jit(*a, **k):
    raise RuntimeError("torch's JIT extension loader was used")
ce.load = no_jit
from engine import native
m = native.load()
print("LOADED" if m is not None and hasattr(m, "__file__") else "PORTABLE")
"""


def built_library() -> str:
    found = sorted(glob.glob(os.path.join(native.build_dir(), "cpuserve_C*.so")))
    if not found:
        pytest.skip(f"no native build in {native.build_dir()} (no compiler on this host)")
    return found[-1]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def run_probe(build: Path, tmp_path: Path) -> str:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir(exist_ok=True)
    env = {**os.environ, "CPUSERVE_BUILD_DIR": str(build), "PATH": str(empty_bin), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("CPUSERVE_NATIVE", None)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture
def prebuilt(tmp_path: Path) -> Path:
    """A build folder holding only the library and the record a build writes."""
    build = tmp_path / "native"
    build.mkdir()
    library = shutil.copy(built_library(), build)
    env = {**os.environ, "CPUSERVE_BUILD_DIR": str(build)}
    subprocess.run([sys.executable, "-c", f"from engine import native; native.write_manifest({library!r})"],
                   cwd=ROOT, env=env, check=True, timeout=300)
    return build


def test_recorded_build_loads_without_compiler_or_writes(prebuilt: Path, tmp_path: Path) -> None:
    before = snapshot(prebuilt)
    assert run_probe(prebuilt, tmp_path) == "LOADED"
    assert snapshot(prebuilt) == before, "loading wrote into the build folder: a read-only root would fail"


def test_record_of_other_sources_is_not_trusted(prebuilt: Path, tmp_path: Path) -> None:
    manifest = prebuilt / "prebuilt.json"
    record = json.loads(manifest.read_text())
    record["fingerprint"] = "0" * 64  # built from other kernel sources
    manifest.write_text(json.dumps(record))
    # The stale library is not imported; the JIT loader (here: failing, no compiler) is tried,
    # and the engine falls back to portable kernels instead of running old code.
    assert run_probe(prebuilt, tmp_path) == "PORTABLE"


def test_fingerprint_changes_with_any_kernel_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "engine" / "csrc", csrc)
    monkeypatch.setattr(native, "_CSRC", str(csrc))
    first = native.source_fingerprint()
    assert native.source_fingerprint() == first
    header = sorted(csrc.glob("*.h"))[0]  # a header change alone must invalidate the build too
    header.write_text(header.read_text() + "\n// changed\n")
    assert native.source_fingerprint() != first


def test_a_build_records_what_a_later_process_loads(tmp_path: Path) -> None:
    """``python -m engine.native`` (make install, the Dockerfile's build stage) must write a record
    that the next process trusts.  torch's JIT loader appends its own flags to the ldflags list it
    is handed; a record of the lengthened list matched no fresh process, so every start went back
    through the JIT loader, and a compiler-free image ran the portable kernels."""
    build = tmp_path / "native"
    shutil.copytree(os.path.dirname(built_library()), build)  # objects and ninja state: nothing to recompile
    (build / "prebuilt.json").unlink(missing_ok=True)
    env = {**os.environ, "CPUSERVE_BUILD_DIR": str(build)}
    env.pop("CPUSERVE_NATIVE", None)
    out = subprocess.run([sys.executable, "-m", "engine.native"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0 and "built" in out.stdout, out.stderr
    assert run_probe(build, tmp_path) == "LOADED"
