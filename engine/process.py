"""What the engine does to its own process and threads, outside any model code.

Three tweaks, each bounding a resource a long-running server would otherwise lose to the
libraries underneath: oneDNN's per-shape caches, glibc's freed heap, and an idle thread's
OpenMP worker team; and the garbage collector kept off the imports' objects while a model loads.
(Measurements behind them: benchmarks/HISTORY.md, "process tweaks" and "start-up".)
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from typing import Iterator

import torch

# Entries in each of oneDNN's two per-shape primitive caches (ideep's and oneDNN's own; 1024 by
# default): a server meets a new matmul shape for nearly every batch size and prompt-chunk
# length, and 64 hold every layer's shapes for several recent batch sizes.
ONEDNN_CACHE_CAPACITY = "64"
_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: also free the thread team, not only idle it


def bound_onednn_caches() -> None:
    """Cap oneDNN's per-shape caches unless the user set them; call before the first matmul
    (oneDNN reads them lazily then), so resident memory stops growing with each new shape."""
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(name, ONEDNN_CACHE_CAPACITY)


@contextlib.contextmanager
def existing_objects_frozen() -> Iterator[None]:
    """Keep the objects alive at entry out of the cyclic collector's passes until exit
    (``gc.freeze``, then ``gc.unfreeze``), for loading a model.

    After importing torch a full collection walks every object torch made; a GGUF vocabulary's
    strings set such passes off while loading, and the loader's final collect is one more.
    Unfrozen at exit, because objects left frozen no longer count toward the collector's threshold
    for a full pass (a quarter of the old generation), so a server serving with them frozen ran
    full passes over its own objects every few dozen tokens (benchmarks/HISTORY.md, "start-up").
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def release_freed_memory() -> None:
    """Hand freed heap (the loader's temporary buffers) back to the OS; glibc keeps it otherwise."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def release_openmp_team() -> None:
    """Free the calling thread's OpenMP worker team (OpenMP 5.0 ``omp_pause_resource_all``).

    libgomp gives every thread that starts a parallel region its own team and frees it only
    when the thread exits.  Once more OpenMP threads exist than cores, workers stop spinning
    between regions, so a team left behind by the thread that loaded or warmed up the engine
    slows the engine thread's every step.
    """
    if "OpenMP" not in torch.__config__.parallel_info():
        return
    try:
        ctypes.CDLL(None).omp_pause_resource_all(_OMP_PAUSE_HARD)
    except (OSError, AttributeError):  # not libgomp / too old: nothing to free
        pass
