"""engine/envs.py is the complete list of environment variables, and README.md documents each."""

from __future__ import annotations

import re

import pytest

from engine import envs
from service.__main__ import build_parser
from tests import ROOT

README = (ROOT / "README.md").read_text()


def _flag_env_names() -> set[str]:
    """The variables the server's flags read (--help and --version read none)."""
    actions = [a for a in build_parser({})._actions if a.dest not in ("help", "version")]
    return {envs.flag_env_name(opt) for a in actions for opt in a.option_strings if opt.startswith("--")}


def _names_in_code() -> set[str]:
    """CPUSERVE_* names the engine and service mention: in Python anywhere (messages, docs, reads),
    in C++ where it calls getenv (its CPUSERVE_HAVE_* are compile-time macros, not variables)."""
    names: set[str] = set()
    for pkg in ("engine", "service"):
        for path in (ROOT / pkg).rglob("*.py"):
            names |= set(re.findall(r"\bCPUSERVE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
        for path in [*(ROOT / pkg).rglob("*.cpp"), *(ROOT / pkg).rglob("*.h")]:
            names |= set(re.findall(r'getenv\("([A-Z0-9_]+)"\)', path.read_text()))
    return names


def _readme_table_names() -> set[str]:
    return set(re.findall(r"^\| (?:`--[a-z0-9-]+` \| )?`([A-Z][A-Z0-9_]+)` \|", README, re.M))


def test_every_variable_the_code_mentions_is_registered_and_documented():
    flags = _flag_env_names()
    names = _names_in_code()
    assert {"CPUSERVE_ATTN_ISA", "CPUSERVE_ATTN_BF16_DOT", "CPUSERVE_NATIVE"} <= names  # the scan works
    unregistered = sorted(n for n in names if n not in envs.environment_variables and n not in flags)
    assert not unregistered, f"add these to engine/envs.py: {unregistered}"
    documented = _readme_table_names()
    missing = sorted((set(envs.environment_variables) | flags) - documented)
    assert not missing, f"add these to README.md's environment tables: {missing}"


def test_reads_parse_at_access_time(monkeypatch):
    monkeypatch.setenv("CPUSERVE_ATTN_ISA", " VEC256 ")
    assert envs.CPUSERVE_ATTN_ISA == "vec256"
    monkeypatch.setenv("CPUSERVE_NATIVE", "0")
    assert envs.CPUSERVE_NATIVE is False
    monkeypatch.delenv("CPUSERVE_NATIVE")
    assert envs.CPUSERVE_NATIVE is True
    monkeypatch.setenv("OMP_NUM_THREADS", "abc")
    assert envs.OMP_NUM_THREADS is None
    assert envs.read("CPUSERVE_TEST_FAULTS", {"CPUSERVE_TEST_FAULTS": "1"}) is True
    with pytest.raises(AttributeError):
        envs.CPUSERVE_NO_SUCH_VARIABLE  # noqa: B018


def test_flag_rule():
    assert envs.flag_env_name("--kv-cache-gb") == "CPUSERVE_KV_CACHE_GB"
    assert envs.flag_env_value("--kv-cache-gb", {"CPUSERVE_KV_CACHE_GB": "2"}) == "2"
    assert "CPUSERVE_KV_CACHE_GB" in _flag_env_names()
