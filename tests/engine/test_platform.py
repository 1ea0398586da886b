"""engine/platform.py: one Isa enum shared with the extension, one CPU feature check, and the
settings the extension takes from the environment at load (engine/native.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import native, platform
from tests import ROOT

EXT = native.module_with("cpu_supports")
needs_ext = pytest.mark.skipif(EXT is None, reason="native extension unavailable")


@needs_ext
def test_isa_enum_matches_the_extension():
    """Every path of isa.h has the same name and value in Python, and the C++ names are the labels."""
    assert {name: int(v) for name, v in EXT.Isa.__members__.items()} == {i.name: int(i) for i in platform.Isa}
    for isa in platform.Isa:
        assert EXT.isa_name(int(isa)) == isa.label
    assert EXT.isa_name(len(platform.Isa)) == ""


@needs_ext
def test_feature_check_agrees_with_cpuinfo():
    """The extension's cpuid check and /proc/cpuinfo see the same features (AMX only where Linux
    granted the tiles, so a subset there), and each Isa is runnable exactly when its features are."""
    ext_features = set(EXT.cpu_features())
    proc = platform.cpuinfo_flags() & platform.KNOWN_FEATURES
    if not proc:
        pytest.skip("/proc/cpuinfo unreadable")
    amx = {f for f in platform.KNOWN_FEATURES if f.startswith("amx_")}
    assert ext_features - amx == proc - amx
    assert ext_features & amx <= proc & amx
    assert platform.cpu_features() == frozenset(ext_features)
    for isa in platform.Isa:
        assert platform.supports(isa) == platform.cpu_can(isa) or isa in (platform.Isa.AMX_INT8, platform.Isa.AMX_BF16)
    assert platform.supports(platform.Isa.SCALAR)


@needs_ext
def test_every_kernel_group_offers_only_supported_paths():
    """qlinear, fused ops and argmax list their paths in the one enum, each one the check allows."""
    runnable = set(platform.isas())
    for listing in (EXT.qlinear_isas(), EXT.qlinear_rows_isas(), EXT.fused_isas(), EXT.argmax_isas()):
        assert listing and set(listing) <= runnable
        assert platform.Isa.SCALAR in listing
    assert EXT.argmax_best_isa() == max(EXT.argmax_isas(), key=[0, 1, 5].index)
    attention = {"vec256": platform.Isa.AVX2, "vec512": platform.Isa.AVX512_BF16, "amx": platform.Isa.AMX_BF16,
                 "amx_emu": platform.Isa.AMX_BF16_EMU}
    assert set(EXT.attention_isas()) == {name for name, isa in attention.items() if platform.supports(isa)}


def test_fallback_parses_cpuinfo(tmp_path, monkeypatch):
    """Without the extension the features come from /proc/cpuinfo, filtered to the known ones,
    and no native path counts as supported."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c avx512f amx_tile\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert platform.cpuinfo_flags(str(info)) == {"fpu", "sse2", "avx2", "fma", "f16c", "avx512f", "amx_tile"}
    assert platform.cpuinfo_flags(str(tmp_path / "missing")) == frozenset()
    monkeypatch.setattr(platform, "_extension", lambda: None)
    monkeypatch.setattr(platform, "cpuinfo_flags", lambda path="/proc/cpuinfo": frozenset({"avx2", "fma", "f16c", "sse2"}))
    platform.cpu_features.cache_clear()
    platform.supports.cache_clear()
    try:
        assert platform.cpu_features() == {"avx2", "fma", "f16c"}
        assert platform.has("avx2") and not platform.has("avx512f")
        assert platform.cpu_can(platform.Isa.AVX2) and not platform.cpu_can(platform.Isa.AVX512)
        assert platform.isas() == []
        with pytest.raises(ValueError, match="unknown CPU feature"):
            platform.has("sse2")
    finally:
        platform.cpu_features.cache_clear()
        platform.supports.cache_clear()


@needs_ext
@pytest.mark.parametrize(("value", "expected"), [("12", 12), ("0", 1), ("many", 4)])
def test_amx_min_rows_is_set_from_the_environment_at_load(value, expected):
    """CPUSERVE_ATTN_AMX_MIN_ROWS reaches the kernel through engine/native.py (the C++ reads no
    environment); a value that is not an integer is ignored with a warning."""
    code = "from engine import native; print(native.load().attention_amx_min_rows())"
    env = {**os.environ, "CPUSERVE_ATTN_AMX_MIN_ROWS": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) == expected
    if value == "many":
        assert "ignoring CPUSERVE_ATTN_AMX_MIN_ROWS" in out.stderr
