"""benchmarks/soak.py, short: its own server, mixed traffic for ~35 s, every request accounted for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import service_command, service_env

from .conftest import ROOT, STARTUP_TIMEOUT

DURATION_S = float(os.environ.get("CPUSERVE_SOAK_TEST_DURATION", "35"))


def test_short_soak_loses_nothing_and_leaks_no_blocks(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "soak.py"),
        "--duration", str(DURATION_S), "--concurrency", "24", "--seed", "7",
        "--json-out", str(out), "--server-log", str(tmp_path / "server.log"),
        "--startup-timeout", str(STARTUP_TIMEOUT), "--request-timeout", "90",
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=service_env(), capture_output=True, text=True,
                       timeout=DURATION_S + STARTUP_TIMEOUT + 300)
    report = r.stdout + r.stderr[-3000:]
    assert out.exists(), report + (tmp_path / "server.log").read_text(errors="replace")[-3000:]
    res = json.loads(out.read_text())
    assert res["lost"] == 0 and res["errored"] == 0, report
    assert res["kv_blocks_in_use_end"] == 0 and res["running_end"] == 0 and res["waiting_end"] == 0, report
    assert res["accounted"] == res["sent"] > 0, report
    assert sum(res[k] for k in ("completed", "rejected", "cancelled", "refused", "errored", "lost")) == res["sent"]
    for kind in ("completed", "cancelled", "refused"):
        assert res[kind] > 0, f"no {kind} requests: {report}"
    assert res["server_exit_status"] == 0, report
    assert not res["health_failures"], report
    assert r.returncode == 0, report
    # what the server counted agrees: no step failed, every 429 was a queue_full rejection
    assert res["server"]["finished"]["error"] == 0
    assert res["server_log_errors"] == 0, report
    assert res["server"]["rejected"]["queue_full"] == sum(
        v.get("rejected", 0) for v in res["by_kind"].values())
    assert "lost                 0" in r.stdout and "KV blocks in use end 0" in r.stdout


def test_own_server_passes_a_key_that_starts_with_a_dash() -> None:
    """The soak's random API key (token_urlsafe) starts with "-" one time in 64: the server's own
    parser must still read it as the key (it once exited with "expected one argument")."""
    from benchmarks import soak
    from service.__main__ import build_parser

    cmd = service_command(8000, soak.server_args("-Ab_c", ["--max-num-seqs", "8"]))
    args = build_parser({}).parse_args(cmd[cmd.index("service") + 1:])
    assert args.api_key == "-Ab_c" and args.max_num_seqs == 8
