"""Everything the benchmarks and the end-to-end tests need around a server process, in one place.

- ports and probes: :func:`free_port`, :func:`http_status`;
- a server as a process: :func:`launch` (any command: ours, llama-server, ...), :func:`adopt` (one a
  script started, as vLLM's), :func:`launch_service` (``python -m service``), and
  :class:`ServerProcess` to wait for ``GET /health`` (timing launch to healthy), signal, freeze and
  stop it, and read its log;
- what a process tree costs: :func:`process_tree`, :func:`rss_bytes`, :class:`RssSampler` (peak
  RSS under load), :class:`NoiseMeter` (CPU that *other* processes used meanwhile);
- :func:`percentile`, as every report here computes it.

Only the standard library and numpy: the comparison, the soak, the serving benchmarks and the e2e
fixtures all import it, and the device machine (no fastapi) runs some of them.  Everything reads
``/proc``, so it is Linux-only, as the servers it measures are.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"
HEALTH_PATH = "/health"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------------------------------
# Ports, probes, statistics
# --------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback TCP port nothing listens on right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int:
    """The HTTP status of ``GET url``; 0 when nothing answers (refused, reset, timed out)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:  # noqa: BLE001 - any failure to get an answer is "no answer"
        return 0


def percentile(values: Sequence[float], p: float) -> Optional[float]:
    """The ``p``-th percentile (0-100) of ``values``, interpolated linearly between the closest ranks
    (numpy's default, which vLLM's serving benchmark reports too); None when there are none."""
    return float(np.percentile(values, p)) if len(values) else None


def tail(path: Union[str, Path], n: int = 15) -> str:
    """The last ``n`` lines of a (log) file, from its last 8 KiB; "" if it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-n:])
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------------
# Process trees: who belongs to a server, what memory and CPU they use (/proc)
# --------------------------------------------------------------------------------------------------


def proc_stat(pid: int) -> Optional[tuple[int, int]]:
    """(ppid, session id) of a live process; None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rfind(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[3])


def process_tree(root: int, sid: Optional[int] = None) -> set[int]:
    """``root`` and all its live descendants, plus every live process of session ``sid`` (a server
    started as a session leader keeps workers that re-parent to init in its session)."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = proc_stat(int(d))
            if st is not None:
                stats[int(d)] = st
    pids = {root} if root in stats else set()
    if sid is not None:
        pids |= {p for p, (_, s) in stats.items() if s == sid}
    children: dict[int, list[int]] = {}
    for p, (pp, _) in stats.items():
        children.setdefault(pp, []).append(p)
    todo = list(pids)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in pids:
                pids.add(c)
                todo.append(c)
    return pids


def _kib_field(path: str, key: str) -> Optional[int]:
    """The ``key:  N kB`` line of a /proc file, in bytes; None if the file or the line is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes(pids: set[int], pss: bool = True) -> tuple[int, int]:
    """(sum of VmRSS, sum of Pss) over ``pids``, in bytes; gone processes count 0.  RSS counts a
    page shared by two processes twice, Pss splits it between them (read only when ``pss``)."""
    rss = pss_sum = 0
    for p in pids:
        r = _kib_field(f"/proc/{p}/status", "VmRSS:")
        if r is None:
            continue
        rss += r
        if pss:
            pss_sum += _kib_field(f"/proc/{p}/smaps_rollup", "Pss:") or 0
    return rss, pss_sum


class RssSampler(threading.Thread):
    """Samples the RSS of ``tree()`` every ``interval`` s in the background: the peak under load."""

    def __init__(self, tree: Callable[[], set[int]], interval: float = 0.5):
        super().__init__(daemon=True)
        self.tree, self.interval = tree, interval
        self.peak = 0
        self.seen: set[int] = set()
        self._stop_evt = threading.Event()

    def sample(self) -> None:
        pids = self.tree()
        self.seen |= pids
        self.peak = max(self.peak, rss_bytes(pids, pss=False)[0])

    def run(self) -> None:
        self.sample()
        while not self._stop_evt.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        """Stop sampling, with one last sample: a run shorter than ``interval`` still has a peak."""
        self._stop_evt.set()
        self.join(timeout=5)
        self.sample()


def cpu_busy_s() -> float:
    """CPU seconds spent busy machine-wide (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / _CLK_TCK  # minus idle and iowait; guest time is within user


def tree_cpu_s(pids: set[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (gone ones count 0)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
        except OSError:
            continue
        fields = s[s.rfind(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _CLK_TCK


class NoiseMeter:
    """CPU used by processes other than the server under test and this process, in cores, over a span.

    The hosts here are shared: with a 2-thread server on 2 cores even a little foreign load distorts
    a figure, so a benchmark records this next to each one and flags the disturbed runs.
    """

    def __init__(self, srv: "ServerProcess"):
        self.srv = srv
        self.t0 = time.monotonic()
        self.busy0 = cpu_busy_s()
        self.mine0 = tree_cpu_s(srv.tree()) + self._self_cpu()
        self.pids0 = set(srv.seen_pids)

    @staticmethod
    def _self_cpu() -> float:
        t = os.times()
        return t.user + t.system

    def cores(self) -> float:
        """Average cores the other processes kept busy since this meter was made."""
        dt = time.monotonic() - self.t0
        pids = self.srv.tree() | self.pids0
        mine = tree_cpu_s(pids) + self._self_cpu() - self.mine0
        other = cpu_busy_s() - self.busy0 - mine
        return max(0.0, other / dt) if dt > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# A server process
# --------------------------------------------------------------------------------------------------


@dataclass
class ServerProcess:
    """One HTTP server on a loopback port, started as the leader of its own session.

    ``proc`` is the ``Popen`` when this process launched it (None when a script did, see
    :func:`adopt`); ``launched`` is ``time.monotonic()`` right before the launch, so
    :meth:`wait_healthy` can say how long start-up took.  ``seen_pids`` remembers every process of
    its tree ever seen, so that clean-up reaches workers that went before it looked.
    """

    name: str
    port: int
    log_path: Path
    pid: int = 0
    proc: Optional[subprocess.Popen] = None
    cmd: list[str] = field(default_factory=list)
    seen_pids: set[int] = field(default_factory=set)
    launched: float = 0.0
    stopped: bool = False

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return proc_stat(self.pid) is not None

    def tree(self) -> set[int]:
        """The server's live processes (its descendants and its session), remembered in ``seen_pids``."""
        pids = process_tree(self.pid, sid=self.pid)
        self.seen_pids |= pids
        return pids

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 6000) -> str:
        """The last ``n`` characters of the log."""
        return self.log()[-n:]

    def wait_healthy(self, timeout: float, interval: float = 0.1, path: str = HEALTH_PATH) -> float:
        """Poll ``GET path`` (``/health``) until it answers 200; the seconds from launch to then
        (the start-up time).

        Raises RuntimeError, with the log's last lines, when the server exits first or ``timeout``
        s pass.  A short ``interval`` keeps the start-up figure within 0.1 s of the truth.
        """
        deadline = time.monotonic() + timeout
        status = 0
        while True:
            status = http_status(self.url + path, timeout=5.0)
            if status == 200:
                return time.monotonic() - self.launched
            if not self.alive():
                code = f" with {self.proc.returncode}" if self.proc is not None else ""
                raise RuntimeError(f"{self.name} server exited{code} before {path} was 200; "
                                   f"log: {self.log_path}\n{tail(self.log_path)}")
            self.tree()  # remember its pids for clean-up
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} server: {path} not 200 after {timeout:.0f} s (last status "
                                   f"{status or 'none'}); log: {self.log_path}\n{tail(self.log_path)}")
            time.sleep(interval)

    def signal(self, sig: int) -> None:
        """``sig`` to the server's leader only (SIGTERM there is its graceful drain)."""
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def signal_tree(self, sig: int) -> None:
        """``sig`` to every process of the tree (SIGSTOP / SIGCONT freeze an idle server whole)."""
        for p in self.tree():
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 30.0) -> Optional[int]:
        """SIGTERM the leader, wait up to ``grace`` s for the whole tree to exit, SIGKILL what is
        left; the leader's exit status (None for an adopted server, whose status is its parent's)."""
        self.stopped = True
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while True:
            pids = self.tree()
            if not pids:
                break
            if time.monotonic() > deadline:
                print(f"[{self.name}] still running after SIGTERM + {grace:.0f} s: SIGKILL {sorted(pids)}",
                      file=sys.stderr)
                for p in pids:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if self.proc is not None:
                    try:
                        self.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                break
            time.sleep(0.1)
        # Intel's OpenMP runtime (vLLM-CPU's) leaves these behind; remove only those of our processes.
        for p in self.seen_pids:
            try:
                os.remove(f"/dev/shm/__KMP_REGISTERED_LIB_{p}_0")
            except OSError:
                pass
        return self.proc.poll() if self.proc is not None else None


def launch(name: str, cmd: Sequence[str], port: int, log_path: Union[str, Path], cwd: Optional[Union[str, Path]] = None,
           env: Optional[dict[str, str]] = None) -> ServerProcess:
    """Start ``cmd`` (a server that will listen on ``port``) in a session of its own, its stdout and
    stderr to ``log_path``; ``env`` None inherits this process's environment."""
    launched = time.monotonic()
    with open(log_path, "wb") as log:
        p = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                             env=env, start_new_session=True)
    return ServerProcess(name, port, Path(log_path), pid=p.pid, proc=p, cmd=list(cmd), launched=launched)


def adopt(name: str, pid: int, port: int, log_path: Union[str, Path], cmd: Sequence[str],
          launched: float) -> ServerProcess:
    """A server that a launcher script started (and made a session leader) as process ``pid``."""
    return ServerProcess(name, port, Path(log_path), pid=pid, cmd=list(cmd), launched=launched)


# ---- this service: ``python -m service`` --------------------------------------------------------------


def service_flag_env() -> set[str]:
    """The environment variables that stand for the service's own flags (``CPUSERVE_<FLAG>``)."""
    from engine.envs import flag_env_name
    from service.__main__ import build_parser

    return {flag_env_name(a.option_strings[0]) for a in build_parser({})._actions
            if a.option_strings and a.option_strings[0].startswith("--")}


def service_env(**extra: str) -> dict[str, str]:
    """This environment without the service's flag variables (a developer's shell must not change
    a server started for a test or a soak; engine settings such as CPUSERVE_BUILD_DIR pass), plus
    ``extra``."""
    flags = service_flag_env()
    env = {k: v for k, v in os.environ.items() if k not in flags}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def service_command(port: int, args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """``python -m service`` on loopback ``port`` with ``args``."""
    return [python, "-m", "service", "--host", LOOPBACK, "--port", str(port), *args]


def launch_service(name: str, args: Sequence[str], log_path: Union[str, Path], port: int = 0,
                   env: Optional[dict[str, str]] = None, python: str = sys.executable,
                   cwd: Union[str, Path] = REPO) -> ServerProcess:
    """Start ``python -m service`` (from ``cwd``, this checkout by default) on ``port`` (0: a free
    one); ``env`` None means :func:`service_env`.  Does not wait: see ``wait_healthy``."""
    port = port or free_port()
    return launch(name, service_command(port, args, python), port, log_path, cwd=cwd,
                  env=service_env() if env is None else env)
