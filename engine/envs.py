"""Every environment variable the engine and the service read: name, type, default, meaning.

Read one as an attribute, ``envs.CPUSERVE_ATTN_ISA``: the value is parsed from ``os.environ``
at that moment (tests set variables with monkeypatch), so callers keep their own caching.
The server's flags are not listed one by one: each ``--flag`` also reads ``CPUSERVE_<FLAG>``
(``flag_env_name``, ``flag_env_value``), and README.md's flag table lists them.  Two
variables configure the native kernels; ``engine/native.py`` reads them here and hands them to
the extension as it loads (the C++ code reads no environment variable).
tests/engine/test_envs.py checks that every ``CPUSERVE_*`` name in engine/ and service/ is here and in
README.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

FLAG_ENV_PREFIX = "CPUSERVE_"


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str  # as documented: "str", "int", "bool", "path"
    default: str  # as documented ("" where unset means a computed default)
    doc: str
    parse: Callable[[Optional[str]], Any]


def _str_lower(raw: Optional[str]) -> str:
    return (raw or "").strip().lower()


def _str_stripped(raw: Optional[str]) -> str:
    return (raw or "").strip()


def _opt_int(raw: Optional[str]) -> Optional[int]:
    return int(raw) if raw else None


def _positive_int(raw: Optional[str]) -> Optional[int]:
    return int(raw) if raw and raw.isdigit() and int(raw) > 0 else None


_VARS = (
    EnvVar("CPUSERVE_NATIVE", "bool", "1", "`0` runs the portable torch kernels only (no native extension)",
           lambda raw: raw != "0"),
    EnvVar("CPUSERVE_BUILD_DIR", "path", "<repo>/build/native",
           "where the native extension is built and found (a build records itself in `prebuilt.json` there)",
           lambda raw: raw or None),
    EnvVar("CPUSERVE_ATTN_ISA", "str", "", "highest attention kernel selection may pick: `amx`, `vec512`, `vec256`, `ref`",
           _str_lower),
    EnvVar("CPUSERVE_ATTN_BF16_DOT", "str", "", "how `vec512` attention multiplies bf16: `dpbf16` or `fma` (default: timed once)",
           _str_stripped),
    EnvVar("CPUSERVE_ATTN_AMX_MIN_ROWS", "int", "4", "query rows from which an attention work unit uses AMX tiles (below: vec512)",
           lambda raw: max(1, int(raw)) if raw else 4),
    EnvVar("CPUSERVE_PACKED_MAX_ROWS", "int", "", "largest batch the packed low-bit matmul runs at the weight's own activation precision",
           _opt_int),
    EnvVar("CPUSERVE_PACKED_ACT_BITS", "int", "", "activation precision of the packed low-bit matmul", _opt_int),
    EnvVar("CPUSERVE_ROWS_INT8_MIN_ROWS", "int", "",
           "batch size from which Q4 weights use their row-int8 copies (default: timed at load); pins the routing across restarts",
           _str_stripped),
    EnvVar("CPUSERVE_TEST_FAULTS", "bool", "0", "TEST ONLY: `1` lets prompt markers inject engine faults (`service/faults.py`)",
           lambda raw: raw == "1"),
    EnvVar("XDG_CACHE_HOME", "path", "~/.cache", "parent of `cpuserve/packed`, the on-disk cache of a GGUF file's packed layouts",
           lambda raw: raw or None),
    EnvVar("OMP_NUM_THREADS", "int", "", "model threads when `--threads` is not given (default: the CPUs in the affinity mask)",
           _positive_int),
)

environment_variables: dict[str, EnvVar] = {v.name: v for v in _VARS}


def read(name: str, env: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of registered variable ``name`` in ``env`` (default: the process environment)."""
    var = environment_variables[name]
    return var.parse((os.environ if env is None else env).get(name))


def flag_env_name(flag: str) -> str:
    """The environment variable a server flag also reads: ``--kv-cache-gb`` -> ``CPUSERVE_KV_CACHE_GB``."""
    return FLAG_ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def flag_env_value(flag: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The raw value of ``flag``'s variable in ``env`` (default: the process environment), None when unset."""
    return (os.environ if env is None else env).get(flag_env_name(flag))


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *environment_variables])
