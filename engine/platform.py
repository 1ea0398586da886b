"""What this CPU can do: the one place in Python that knows the host's instruction sets.

``Isa`` mirrors ``engine/csrc/isa.h`` (the extension's instruction-set paths; tests assert the
two match), and the features and paths come from the extension's one CPU check when it is built
(``cpu_supports`` / ``cpu_features`` in ``isa.cpp``, which also asks Linux for the AMX tile
state), else from one parse of ``/proc/cpuinfo``.  Kernel dispatch (attention, matmuls,
sampling) asks here instead of reading CPU flags itself.
"""

from __future__ import annotations

import enum
import functools
from types import ModuleType
from typing import Optional

from engine import native


class Isa(enum.IntEnum):
    """An instruction-set path of the extension (``cpuserve::Isa``); the values are the ``isa``
    arguments the bindings take."""

    SCALAR = 0  # portable C++, the reference every other path matches
    AVX2 = 1  # AVX2 + FMA + F16C
    AVX_VNNI = 2  # AVX2 + AVX-VNNI
    AVX512_VNNI = 3  # AVX512 + AVX512-VNNI
    AMX_INT8 = 4  # AVX512_VNNI + AMX int8 tiles
    AVX512 = 5  # AVX2 + AVX-512 F/BW/VL/DQ
    AVX512_BF16 = 6  # AVX512 + AVX512-BF16
    AMX_BF16 = 7  # AVX512_BF16 + AMX bf16 tiles
    AMX_BF16_EMU = 8  # AMX_BF16's kernels on emulated tiles (tests; runs where AVX512_BF16 does)

    @property
    def label(self) -> str:
        """The name logs, benchmarks and ``isa_name`` in C++ use: ``avx512-vnni``, ``amx-bf16``..."""
        return self.name.lower().replace("_", "-")


# The CPU features (in /proc/cpuinfo's spelling) that some path of the extension needs, and the
# ones each Isa needs: the same table as isa.cpp's, for hosts without the extension.
KNOWN_FEATURES = frozenset(
    {"avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
     "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
)
_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ISA_FEATURES: dict[Isa, frozenset[str]] = {
    Isa.SCALAR: frozenset(),
    Isa.AVX2: _AVX2,
    Isa.AVX_VNNI: _AVX2 | {"avx_vnni"},
    Isa.AVX512_VNNI: _AVX512 | {"avx512_vnni"},
    Isa.AMX_INT8: _AVX512 | {"avx512_vnni", "amx_tile", "amx_int8"},
    Isa.AVX512: _AVX512,
    Isa.AVX512_BF16: _AVX512 | {"avx512_bf16"},
    Isa.AMX_BF16: _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"},
    Isa.AMX_BF16_EMU: _AVX512 | {"avx512_bf16"},
}


def _extension() -> Optional[ModuleType]:
    """The extension when it is built here and has the CPU check, else None."""
    return native.module_with("cpu_supports")


def cpuinfo_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """Every feature flag of the first CPU in ``path`` (empty when unreadable): the fallback
    when the extension is not built."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The features in :data:`KNOWN_FEATURES` this host has, as /proc/cpuinfo spells them.

    From the extension's check when it is built (there ``amx_*`` means usable by this process:
    Linux granted the tile state), else from /proc/cpuinfo (``amx_*`` as the CPU reports them).
    """
    ext = _extension()
    if ext is not None:
        return frozenset(ext.cpu_features())
    return cpuinfo_flags() & KNOWN_FEATURES


def has(feature: str) -> bool:
    """Whether this host has ``feature`` (a /proc/cpuinfo name from :data:`KNOWN_FEATURES`)."""
    if feature not in KNOWN_FEATURES:
        raise ValueError(f"unknown CPU feature {feature!r}; known: {', '.join(sorted(KNOWN_FEATURES))}")
    return feature in cpu_features()


@functools.lru_cache(maxsize=None)
def supports(isa: Isa) -> bool:
    """Whether this process can run ``isa``'s native kernels: the extension is built (with that
    path compiled in) and the CPU has the features.  False for every Isa without the extension."""
    ext = _extension()
    return ext is not None and bool(ext.cpu_supports(int(isa)))


def cpu_can(isa: Isa) -> bool:
    """Whether this CPU has ``isa``'s features, extension or not (what a build here could run)."""
    return ISA_FEATURES[Isa(isa)] <= cpu_features()


def isas() -> list[Isa]:
    """Every Isa this process can run (:func:`supports`), in enum order."""
    return [isa for isa in Isa if supports(isa)]
