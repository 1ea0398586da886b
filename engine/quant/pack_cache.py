"""An on-disk cache of a model's packed layouts, so that a second start-up maps them instead of
repacking (repacking a 1B model's blocks takes seconds of torch ops; mapping takes none): a GGUF
file's own blocks, and weights quantized at load (``--weight-quant q4_0`` on a Hugging Face
directory: ~16 s for a 1B model).

One cache entry per model file, under ``$XDG_CACHE_HOME/cpuserve/packed`` (``~/.cache/cpuserve/packed``),
never beside the model: a read-only model directory works as well as a writable one.  The key is the
file's absolute path, size and modification time (for a directory, those of each of its files), the
type weights are quantized to at load (if any) and the packing code's version, so an edited or
replaced file, another type, or a new layout, misses and is repacked.  Only models whose packed weights reach
:data:`MIN_BYTES` are cached: smaller ones pack faster than a cache would save.  Entries are a flat
``.bin`` of packed bytes plus a ``.json`` index, written atomically; failures to write are logged,
never fatal.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from typing import Optional, Sequence

import numpy as np
import torch

from engine import envs
from engine.quant import blocks
from engine.quant.weights import PackedParts, PackedWeight

logger = logging.getLogger(__name__)

MIN_BYTES = 64 << 20
FORMAT = 1  # of the .bin/.json pair; the packed layout's own version is blocks.py's hash


def cache_dir() -> str:
    base = envs.XDG_CACHE_HOME or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cpuserve", "packed")


@functools.lru_cache(maxsize=1)
def _layout_version() -> str:
    """A hash of the module that defines the packed layout: a layout change invalidates every entry."""
    with open(blocks.__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _source_stamp(src: str) -> str:
    """Path, size and modification time of the model file, or of every file of the model directory."""
    paths = [src] if os.path.isfile(src) else sorted(os.path.join(src, f) for f in os.listdir(src))
    return "\0".join(f"{p}\0{st.st_size}\0{st.st_mtime_ns}" for p in paths if os.path.isfile(p) for st in [os.stat(p)])


class PackCache:
    """Packed weights of one model (a GGUF file or a model directory) by module name: ``get`` what a
    previous run stored, ``put`` what this run packed, ``save`` once all are in.  ``quantized_to``:
    the type dense weights are quantized to at load ("" when none are)."""

    def __init__(self, source: str, directory: Optional[str] = None, quantized_to: str = "") -> None:
        src = os.path.abspath(source)
        variant = f"\0{quantized_to}" if quantized_to else ""  # "" keeps the keys of GGUF files served as they are
        key = hashlib.sha256(
            f"{_source_stamp(src)}\0{FORMAT}\0{_layout_version()}{variant}".encode()
        ).hexdigest()[:24]
        self.base = os.path.join(directory or cache_dir(), f"{os.path.basename(src)}.{key}")
        self._index: dict[str, list[list]] = {}
        self._data: Optional[torch.Tensor] = None
        self._new: dict[str, list[PackedWeight]] = {}
        self._load()

    @property
    def hit(self) -> bool:
        return self._data is not None

    def _load(self) -> None:
        try:
            with open(self.base + ".json") as f:
                index = json.load(f)
            total = sum(p[4] for parts in index.values() for p in parts)
            if os.path.getsize(self.base + ".bin") != total:
                return
            mapped = np.memmap(self.base + ".bin", dtype=np.uint8, mode="c", shape=(total,)) if total else None
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return
        self._index = index
        self._data = torch.from_numpy(mapped) if mapped is not None else torch.empty(0, dtype=torch.uint8)

    def get(
        self, name: str, isa: Optional[str] = None, act_bits: Optional[int] = None
    ) -> "Optional[PackedWeight | PackedParts]":
        """The packed weight stored for module ``name`` (a view of the mapped file), or None."""
        entry = self._index.get(name) if self._data is not None else None
        if not entry:
            return None
        parts = [
            PackedWeight(self._data[off : off + size], qtype, (n, k), isa, act_bits) for qtype, n, k, off, size in entry
        ]
        return parts[0] if len(parts) == 1 else PackedParts(parts)

    def put(self, name: str, packed: "PackedWeight | PackedParts") -> None:
        self._new[name] = list(packed.parts) if isinstance(packed, PackedParts) else [packed]

    def save(self) -> Optional[str]:
        """Write what was ``put`` (if it reaches MIN_BYTES); the entry's path, or None if not written."""
        weights: Sequence[PackedWeight] = [p for parts in self._new.values() for p in parts]
        if self.hit or sum(p.nbytes for p in weights) < MIN_BYTES:
            return None
        index, off = {}, 0
        for name, parts in self._new.items():
            index[name] = []
            for p in parts:
                index[name].append([p.qtype, p.shape[0], p.shape[1], off, p.nbytes])
                off += p.nbytes
        tmp = f"{self.base}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.base), exist_ok=True)
            with open(tmp + ".bin", "wb") as f:
                for p in weights:
                    f.write(memoryview(p.data.numpy()))
            with open(tmp + ".json", "w") as f:
                json.dump(index, f)
            os.replace(tmp + ".bin", self.base + ".bin")
            os.replace(tmp + ".json", self.base + ".json")  # the index last: it marks the entry complete
        except OSError as e:
            logger.warning("could not cache the packed weights in %s: %s", os.path.dirname(self.base), e)
            for path in (tmp + ".bin", tmp + ".json"):
                if os.path.exists(path):
                    os.remove(path)
            return None
        return self.base + ".bin"
