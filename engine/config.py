"""Configuration dataclasses: the one place every tunable lives.

The CLI (``service/__main__.py``) and the offline ``LLM`` class both build an
``EngineConfig``.  Environment variables are read through ``engine/envs.py`` (the one registry
of them), not here: only ``default_num_threads`` consults one (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine import envs

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8_e4m3", "fp8_e5m2")
WEIGHT_QUANTS = ("auto", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "none")  # the types: quant.blocks.QUANTIZE_TYPES
LARGE_BATCH_MATMULS = ("auto", "int8_rows", "int8", "dense")
# Default most memory the row-int8 copies of the weights may take ("auto" large-batch matmuls; one
# byte per weight): small models get them, 0.5B+ ones keep their idle memory near the file's size.
ROWS_INT8_BUDGET_GB = 0.25
# Most KV-cache memory the default prefix-cache reserve (CacheConfig.prefix_cache_gb) takes; the
# server makes the reserve resident at start-up, and one full context of a long-context model
# (Llama 3.2's 131k tokens: 2.2 GB at int8) is far more than a cache of recent prefixes needs.
PREFIX_CACHE_MAX_GB = 0.25


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder, filled in by a loader from GGUF metadata or config.json."""

    architecture: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    rope_scaling: Optional[dict] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()


def default_kv_cache_gb() -> float:
    """A quarter of available RAM, between 0.5 and 8 GiB: enough for long contexts, leaves room for the rest."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        avail_gb = info.get("MemAvailable", info["MemTotal"]) / (1024 * 1024)
    except (OSError, KeyError, ValueError):
        avail_gb = 8.0
    return float(min(8.0, max(0.5, avail_gb / 4)))


def default_num_threads() -> int:
    """Threads for the model: the cores this process may use (cgroup affinity), from OMP_NUM_THREADS if set."""
    env = envs.OMP_NUM_THREADS
    if env is not None:
        return env
    return max(1, len(os.sched_getaffinity(0)))


def default_model_name(source: str) -> str:
    """The served model name when ``served_model_name`` is unset:
    '.../SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'; a directory -> its name."""
    base = os.path.basename(os.path.normpath(source)).removesuffix(".gguf")
    stem, _, last = base.rpartition(".")
    return stem if stem and last.upper().startswith(("Q", "F", "BF", "IQ")) else base


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_gb: Optional[float] = None  # None: default_kv_cache_gb()
    # "auto": int8 for bfloat16 runs where a native attention path reads it in place (AVX-512 VNNI,
    # AVX2), else the run dtype (the engine resolves it: kv_cache.layout.resolve_kv_cache_dtype); "bfloat16" /
    # "float32": the run dtype, unrounded; "int8": one scale per token and kv head; "fp8_e4m3", "fp8_e5m2".
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # Finished requests' blocks kept as cached prefixes before the pool recycles them instead of
    # touching more of its memory (kv_cache.block_pool.BlockPool); None: 1/32 of the pool, at least one full
    # context, at most PREFIX_CACHE_MAX_GB.  The pool's resident part then stops at the peak of live
    # blocks plus this; the server's warm-up makes this much resident up front
    # (LLMEngine.prefault_kv_cache).
    prefix_cache_gb: Optional[float] = None
    num_blocks: Optional[int] = None  # overrides kv_cache_gb; tests use it to force preemption

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.prefix_cache_gb is not None and self.prefix_cache_gb < 0:
            raise ValueError(f"prefix_cache_gb must not be negative, got {self.prefix_cache_gb}")
        if self.block_size <= 0 or self.block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {self.block_size}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    # Prompt tokens per step (each running decode adds its one token on top).  Smaller chunks
    # let waiting prompts start sooner and keep running streams flowing between chunks, since a
    # prompt that arrives as a step starts waits for that whole step; 256 keeps TTFT low at the
    # same throughput (benchmarks/HISTORY.md, "chunk size").
    max_num_batched_tokens: int = 256
    max_model_len: Optional[int] = None  # None: the model's context length
    enable_chunked_prefill: bool = True
    max_waiting: int = 1024  # waiting-queue limit; the service answers 429 beyond it


@dataclass
class EngineConfig:
    model: str = "default"  # "default", a GGUF file or a Hugging Face directory
    dtype: str = "bfloat16"
    served_model_name: Optional[str] = None
    seed: int = 0
    num_threads: int = field(default_factory=default_num_threads)
    # "auto": keep GGUF's Q4/Q8 blocks for small-batch matmuls where kernels exist; "q8_0": also
    # quantize dense checkpoints (lossy); "none": dense weights only.
    weight_quant: str = "auto"
    # Batches above the packed kernel's small-batch limit (prefill, big decode batches):
    # "int8" multiplies the packed blocks with 8-bit activations (faster than dense bf16, logit
    # error comparable to bf16's own rounding); "int8_rows" does so up to a routing threshold
    # and from there uses a copy of the weights as int8 with one scale per row (faster again,
    # ~1 byte per weight more memory, where AVX-512 VNNI or AMX exists; elsewhere it acts as
    # "int8"); "dense" uses the dense matmul; "auto": int8_rows for bfloat16 runs while the
    # copies fit rows_int8_budget_gb (else int8), dense for float32 ones.
    large_batch_matmul: str = "auto"
    # "auto" large-batch matmuls make the row-int8 copies only when they take at most this many
    # GiB ("int8_rows" makes them whatever they take); the engine logs the decision and the bytes.
    rows_int8_budget_gb: float = ROWS_INT8_BUDGET_GB
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}")
        if self.weight_quant not in WEIGHT_QUANTS:
            raise ValueError(f"weight_quant must be one of {WEIGHT_QUANTS}, got {self.weight_quant!r}")
        if self.large_batch_matmul not in LARGE_BATCH_MATMULS:
            raise ValueError(
                f"large_batch_matmul must be one of {LARGE_BATCH_MATMULS}, got {self.large_batch_matmul!r}"
            )
        if self.rows_int8_budget_gb < 0:
            raise ValueError(f"rows_int8_budget_gb must not be negative, got {self.rows_int8_budget_gb}")
        kv = self.cache.kv_cache_dtype
        if kv in _DTYPES and kv != self.dtype:
            raise ValueError(f"kv_cache_dtype {kv} needs dtype {kv} (this run's dtype is {self.dtype})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def large_batch_int8(self) -> bool:
        """Large batches take int8 activations (on the packed blocks or the row-int8 copy)."""
        if self.large_batch_matmul == "auto":
            return self.dtype == "bfloat16"
        return self.large_batch_matmul in ("int8", "int8_rows")

    @property
    def large_batch_rows_int8(self) -> bool:
        """Large batches may use row-scaled int8 copies of the weights (quant.ROWS_INT8_MIN_ROWS)."""
        return self.large_batch_int8 and self.large_batch_matmul in ("auto", "int8_rows")
