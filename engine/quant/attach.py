"""Attaching quantized weights to a model: which projections take packed GGUF blocks (or an opt-in
Q8_0 copy), which the loader need not dequantize, row-int8 copies within their budget, freeing the
dense weights the packed ones fully serve, and the start-up log lines that say which ran dense and why.

``skip_dense`` and ``attach_quantized_weights`` are the engine's two calls: before loading (what
to leave as blocks only) and after (the model surgery).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Collection, Optional, Sequence

from torch import nn

from engine.quant import routing
from engine.quant.pack_cache import PackCache
from engine.quant.packing import pack_gguf, packable, packing_refusal, quantize_dense
from engine.quant.routing import FAMILY, ROWS_INT8_MIN_ROWS, default_max_rows, large_batch_packed
from engine.quant.weights import (
    PackedParts,
    PackedWeight,
    native_available,
    rows_int8_fast,
    rows_int8_from,
    rows_isas,
)

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.layers.linear import Linear
    from engine.loader.types import GGUFTensor, LoadedModel

logger = logging.getLogger(__name__)

def attach_packed(
    linear: "Linear",
    packed: "Optional[PackedWeight | PackedParts]",
    max_rows: Optional[int] = None,
    large_act_bits: int = 0,
    rows_int8: bool = False,
) -> bool:
    """Route ``linear``'s batches of at most ``max_rows`` rows to ``packed`` (and, with
    ``large_act_bits``, larger ones too, at that activation precision; with ``rows_int8`` as
    well, those of :data:`ROWS_INT8_MIN_ROWS` rows or more to a row-scaled int8 copy); False if
    not attached (None, shape mismatch, or no native kernel: the dense path then serves every batch)."""
    if packed is None:
        return False
    if packed.shape != (linear.out_features, linear.in_features):
        raise ValueError(f"packed weight {packed.shape} does not match linear {(linear.out_features, linear.in_features)}")
    if not native_available():
        return False
    linear.packed = packed
    if max_rows is None:
        max_rows = default_max_rows(packed.qtype, packed.act_bits, large_act_bits)
    linear.packed_max_rows = max_rows
    linear.large_act_bits = large_act_bits
    linear.rows_int8 = rows_int8_from(packed) if rows_int8 and large_act_bits else None
    linear.rows_int8_min_rows = ROWS_INT8_MIN_ROWS[FAMILY[packed.qtype]]
    return True


def attach_rows_int8(model: nn.Module) -> int:
    """Give each large-batch packed Linear its row-int8 copy (what ``attach_packed(..., rows_int8=True)``
    does one at a time), for when the engine has decided they fit its budget; returns their bytes."""
    total = 0
    for lin in large_batch_packed(model):
        if lin.rows_int8 is None:
            lin.rows_int8 = rows_int8_from(lin.packed)
        total += lin.rows_int8.nbytes
    return total


def release_dense_weights(model: nn.Module, unfilled: Collection[str] = ()) -> int:
    """Free the dense weight of every Linear whose packed copies serve every batch size (packed
    with ``large_act_bits``: small batches on the blocks, large ones on the blocks or the row-int8
    copy), unless another module shares it (a tied embedding).  Returns the bytes of loaded
    weights freed; ``unfilled`` names parameters the loader never wrote (their pages were never
    resident, so freeing them releases nothing)."""
    from engine.layers.linear import Linear

    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    freed = 0
    for name, lin in model.named_modules():
        if isinstance(lin, Linear) and lin.packed is not None and lin.large_act_bits and id(lin.weight) not in shared:
            if f"{name}.weight" not in unfilled:
                freed += lin.weight.numel() * lin.weight.element_size()
            lin.weight = nn.Parameter(lin.weight.new_empty(0, lin.in_features), requires_grad=False)
    return freed


def dense_summary(reasons: Sequence[tuple[str, str]]) -> str:
    """One log line's worth of (module name, reason) pairs: names that differ only in their layer
    index and share the reason are counted together, e.g. "mlp.down_proj in 16 layers (F16
    8192x2048: F16 has no packed kernel)"."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, why in reasons:
        parts = name.split(".")
        key = ".".join(parts[2:]) if parts[0] == "layers" and len(parts) > 2 else name
        groups.setdefault((key, why), []).append(name)
    return "; ".join(
        f"{key} in {len(names)} layers ({why})" if len(names) > 1 or names[0] != key else f"{key} ({why})"
        for (key, why), names in groups.items()
    )


_MERGED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}


_MERGED_INTO = {src: merged for merged, srcs in _MERGED.items() for src in srcs}
EMBEDDING = "model.embed_tokens.weight"
_UNQUANTIZED = ("F32", "F16", "BF16")


def _linear_sources(name: str, gguf_tensors: dict[str, "GGUFTensor"]) -> list[str]:
    """HF names of the GGUF weights whose rows make the model's Linear ``name`` (``lm_head`` or
    ``layers.<i>.<self_attn|mlp>.<proj>``): q, k, v for qkv_proj; the token embedding for a tied head."""
    if name == "lm_head":
        return ["lm_head.weight"] if "lm_head.weight" in gguf_tensors else [EMBEDDING]
    parts = name.split(".")
    base, key = ".".join(parts[:-2]), ".".join(parts[-2:])
    return [f"model.{base}.{s}.weight" for s in _MERGED.get(key, (key,))]


def _gguf_linears(gguf_tensors: dict[str, "GGUFTensor"]) -> set[str]:
    """Module names of the Linears that these GGUF weights (HF names) make: the inverse of _linear_sources."""
    names = {"lm_head"}
    for hf in gguf_tensors:
        parts = hf.removeprefix("model.").removesuffix(".weight").split(".")  # layers.<i>.<block>.<proj>
        if len(parts) == 4 and parts[0] == "layers" and ".".join(parts[2:]) in _MERGED_INTO:
            names.add(".".join(parts[:2]) + "." + _MERGED_INTO[".".join(parts[2:])])
    return names


def dense_free_weights(gguf_tensors: dict[str, "GGUFTensor"], tied: bool, large_act_bits: int) -> set[str]:
    """HF names of the GGUF weights the engine serves from their blocks alone, so the loader need
    not dequantize them (``engine.loader.types.SkipDense``).

    A projection's weights when :func:`attach_gguf_weights` packs them and large batches use the
    packed blocks too (``large_act_bits``: then :func:`release_dense_weights` frees the dense copy);
    with dense large batches every projection keeps its dense weight.  The token embedding when it
    is quantized and nothing else reads its dense rows: untied, or tied to a head served so
    (engine.layers.embedding then dequantizes the rows a step looks up).  Empty without the native
    extension (nothing is packed).
    """
    if not native_available():
        return set()
    free: set[str] = set()
    if large_act_bits:
        for name in _gguf_linears(gguf_tensors):
            sources = _linear_sources(name, gguf_tensors)
            if all(s in gguf_tensors for s in sources) and packable([gguf_tensors[s] for s in sources]):
                free.update(sources)
    embedding = gguf_tensors.get(EMBEDDING)
    if embedding is not None and embedding.qtype not in _UNQUANTIZED and not tied:
        free.add(EMBEDDING)
    return free


def attach_gguf_weights(
    model: nn.Module,
    gguf_tensors: dict[str, "GGUFTensor"],
    max_rows: Optional[int] = None,
    quantize_to: Optional[str] = None,
    large_act_bits: int = 0,
    rows_int8: bool = False,
    cache: Optional[PackCache] = None,
) -> dict[str, Any]:
    """Attach packed weights to every Linear of a Llama-family model (HF names, as the loader gives).

    Each projection takes its GGUF blocks when there is a kernel for their qtype (a merged one of
    mixed qtypes as :class:`PackedParts`); otherwise, with
    ``quantize_to`` (a GGUF type name; opt-in, lossy), its dense weight quantized to it; else it stays dense.  The
    LM head uses ``lm_head.weight`` or, tied, ``model.embed_tokens.weight``.  With ``rows_int8``
    (and ``large_act_bits``) each also gets a row-scaled int8 copy for large batches.  ``cache``
    supplies packed layouts a previous run stored, and takes this run's.  Returns
    counts, packed bytes (both copies) and, under "dense_reasons", (name, "qtype shape: reason")
    for each projection left dense (:func:`dense_summary` words them for the load log).
    """
    from engine.layers.linear import Linear

    stats: dict[str, Any] = {"packed": 0, "quantized": 0, "dense": 0, "bytes": 0, "dense_reasons": []}
    if not native_available() or (max_rows is not None and max_rows <= 0):
        why = "no native extension" if not native_available() else "packed path disabled (max rows 0)"
        stats["dense_reasons"] = [(n, why) for n, m in model.named_modules() if isinstance(m, Linear)]
        stats["dense"] = len(stats["dense_reasons"])
        return stats
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        sources = _linear_sources(name, gguf_tensors)
        packed, why = None, "not in the file as blocks"
        if all(s in gguf_tensors for s in sources):
            found = [gguf_tensors[s] for s in sources]
            why = packing_refusal(found)
            if why is None:
                packed = cache.get(name) if cache is not None else None
                if packed is None:
                    packed = pack_gguf(found)
                    if cache is not None:
                        cache.put(name, packed)
            else:  # for the load log: which tensors run dense, and why
                kinds = ", ".join(f"{t.qtype} {int(t.shape[0])}x{int(t.shape[1])}" for t in found)
                why = f"{kinds}: {why}"
        if packed is not None:
            stats["packed"] += 1
        elif quantize_to is not None:
            packed = cache.get(name) if cache is not None else None
            if packed is None:
                packed = quantize_dense(module.weight.data, quantize_to)
                if cache is not None:
                    cache.put(name, packed)
            stats["quantized"] += 1
        else:
            stats["dense"] += 1
            stats["dense_reasons"].append((name, why))
            continue
        attach_packed(module, packed, max_rows, large_act_bits, rows_int8)
        stats["bytes"] += packed.nbytes + (module.rows_int8.nbytes if module.rows_int8 is not None else 0)
    return stats


def skip_dense(config: "EngineConfig", model_config: "ModelConfig", gguf_tensors: dict[str, "GGUFTensor"]) -> set[str]:
    """The loader's ``skip_dense`` for an engine run with ``config``: the GGUF weights it will serve
    from their blocks alone (packed projections, a quantized embedding), so they are never dequantized."""
    if config.weight_quant == "none":
        return set()
    large_act_bits = 8 if config.large_batch_int8 else 0
    return dense_free_weights(gguf_tensors, model_config.tie_word_embeddings, large_act_bits)


def attach_quantized_weights(model: nn.Module, config: "EngineConfig", loaded: "LoadedModel", absent: set[str]) -> None:
    """Keep GGUF's low-bit blocks for the model's matmuls where the native kernels exist, and log
    what was decided.

    ``config.weight_quant``: "auto" packs the file's own blocks (exact w.r.t. the weights);
    a type ("q8_0", "q4_0", ...) also quantizes dense weights to it (HF checkpoints; lossy); "none"
    stays dense.
    ``large_batch_matmul`` decides whether batches above the small-batch limit use them too, and
    whether row-int8 copies serve the largest (within ``rows_int8_budget_gb``).  ``absent``: the
    weights loaded without a dense copy (``skip_dense``), which must end up served from their blocks.
    """
    unfilled = _targets(model, loaded.config.tie_word_embeddings, absent)
    if config.weight_quant != "none":
        _attach(model, config, loaded, absent, unfilled)
    _check_served(model, unfilled)
    t0 = time.perf_counter()
    repacked, as_is = routing.route_dense_bf16(model)
    if repacked or as_is:
        logger.info("dense bf16 projections on the native AVX512-BF16 kernel: %d repacked for every batch size (%.1f s), "
                    "%d tied to the embedding as they are for batches of up to %d rows",
                    repacked, time.perf_counter() - t0, as_is, routing.DENSE_BF16_MAX_ROWS)


def _attach(model: nn.Module, config: "EngineConfig", loaded: "LoadedModel", absent: set[str], unfilled: set[str]) -> None:
    from engine.layers.embedding import BlockEmbedding

    large_int8 = config.large_batch_int8
    rows_int8 = config.large_batch_rows_int8
    if rows_int8 and not rows_int8_fast():
        logger.info("no AVX-512 VNNI or AMX here: large batches use the packed blocks, not row-int8 copies")
        rows_int8 = False
    quantize_to = None if config.weight_quant in ("auto", "none") else config.weight_quant.upper()
    cache = None
    if (loaded.gguf_tensors and os.path.isfile(loaded.source)) or (quantize_to and os.path.isdir(loaded.source)):
        cache = PackCache(loaded.source, quantized_to=quantize_to or "")
    stats = attach_gguf_weights(
        model, loaded.gguf_tensors, quantize_to=quantize_to,
        large_act_bits=8 if large_int8 else 0,
        cache=cache,
    )
    if cache is not None and cache.hit:
        logger.info("packed weights mapped from the cache %s.bin (repacked when the file or the layout changes)", cache.base)
    elif cache is not None and (written := cache.save()) is not None:
        logger.info("packed weights cached in %s for the next start-up", written)
    if EMBEDDING in absent:
        model.embed_tokens = BlockEmbedding.from_gguf(loaded.gguf_tensors[EMBEDDING], loaded.source, config.torch_dtype)
        logger.info("token embedding looked up from its %s blocks (%.0f MiB, mapped from the file; no dense copy)",
                    model.embed_tokens.qtype, model.embed_tokens.nbytes / 2**20)
    if stats["dense"]:
        logger.info("dense projections: %s", dense_summary(stats["dense_reasons"]))
    if not (stats["packed"] or stats["quantized"]):
        return
    if rows_int8:
        budget = None if config.large_batch_matmul == "int8_rows" else int(config.rows_int8_budget_gb * 2**30)
        rows_int8, why = routing.rows_int8_decision(routing.rows_int8_bytes(model), budget)
        logger.info("row-int8 weight copies for large batches: %s", why)
    if rows_int8:  # before binding: the native layers copy each projection's routing
        stats["bytes"] += attach_rows_int8(model)
        routing.tune_rows_int8_min_rows(model)
    native_layers = model.bind_packed_layers()
    large = "dense"
    if large_int8:
        large = "packed, int8 activations" + (f"; row-int8 copies ({rows_isas()[-1]}) for larger ones" if rows_int8 else "")
    logger.info(
        "packed weights: %d from the file, %d quantized to %s at load (lossy), %d dense (%.0f MiB); large batches: %s; "
        "%d layers on the native packed path",
        stats["packed"], stats["quantized"], config.weight_quant.upper() if stats["quantized"] else "-", stats["dense"],
        stats["bytes"] / 2**20, large, native_layers,
    )
    freed = release_dense_weights(model, unfilled)
    if freed:
        logger.info("freed %.0f MiB of dense weights that the packed ones fully serve", freed / 2**20)


def _targets(model: nn.Module, tied: bool, absent: Collection[str]) -> set[str]:
    """The model parameters that the weights loaded without a dense copy would have filled."""
    targets = {model.parameter_for(name)[0] for name in absent}
    if "embed_tokens.weight" in targets and tied:
        targets.add("lm_head.weight")
    return targets


def _check_served(model: nn.Module, unfilled: set[str]) -> None:
    """Fail loudly if a weight loaded without its dense copy is still read densely (its parameter
    was never filled): the loader's skip_dense and the packing disagreed."""
    params = dict(model.named_parameters())
    unserved = sorted(t for t in unfilled if t in params and params[t].numel())
    if unserved:
        raise RuntimeError(f"weights loaded without a dense copy are not served by packed kernels: {unserved[:5]}")
