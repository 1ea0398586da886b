"""The native build's lock: a build killed half-way must not hang every later start-up."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from engine import native


def test_stale_torch_lock_is_removed_under_our_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("CPUSERVE_BUILD_DIR", str(tmp_path))
    stale = tmp_path / "lock"  # what torch's FileBaton leaves when its process is killed
    stale.touch()
    with native._build_lock():
        assert not stale.exists()


def test_build_lock_waits_for_a_live_holder_and_not_for_a_dead_one(tmp_path, monkeypatch):
    monkeypatch.setenv("CPUSERVE_BUILD_DIR", str(tmp_path))
    holder = textwrap.dedent(
        """
        import pathlib, sys, time
        from engine import native
        with native._build_lock():
            print("held", flush=True)
            time.sleep(float(sys.argv[1]))
            pathlib.Path(sys.argv[2]).touch()  # the last thing it does while holding the lock
        """
    )
    # A holder that is alive: we wait until it lets go.
    done = tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-c", holder, "1.0", str(done)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with native._build_lock():
        assert done.exists(), "took the lock while another process held it"
    proc.wait()
    # A holder killed while holding it: the kernel drops the lock, nothing hangs.
    proc = subprocess.Popen([sys.executable, "-c", holder, "600", str(done)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    (tmp_path / "lock").touch()  # and torch's file, as a killed build leaves it
    proc.kill()
    proc.wait()
    with native._build_lock():
        assert not (tmp_path / "lock").exists()
