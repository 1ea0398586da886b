"""Packed GGUF-block matmul (and the row-int8 copies large batches use) vs dense bf16
``F.linear`` at the default model's shapes, plus the accuracy cost of the packed kernel's int8
activation rounding on the real model.

    python -m benchmarks.linear_kernels                 # kernel table + one decode token of linears
    python -m benchmarks.linear_kernels --accuracy      # + 64-step decode: packed vs dense float32
    python -m benchmarks.linear_kernels --fused         # + native fused ops vs their torch reference
    python -m benchmarks.linear_kernels --qtypes Q4_K Q4_0 Q8_0 --m 1   # block types at the 1B shapes

Shapes (SmolLM2-135M: hidden 576, intermediate 1536, 9 q heads / 3 kv heads of 64, vocab 49152):
qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576 (Q4_1 in the GGUF), lm_head 576->49152
(the tied Q8_0 token embedding).  Decode streams every weight from memory once per token, so each
shape is timed over rotating copies totalling more than the last-level cache, and GB/s counts the
weight bytes each kernel reads (bf16: 2 per weight; Q4_1: 0.625; Q8_0: 1.0625).

Timings on a shared host are noisy: every figure is the best of several trials (each trial one
pass over all copies), i.e. the uncontended speed.

Measured on the 2-core AMD AVX-512 VNNI development host (logit std 4.2, median top-2 margin 1.2):
64 teacher-forced greedy steps vs the dense float32 model, max |logit diff| / tokens agreeing:
packed a16 fp32 0.013 / 64, packed a16 bf16 0.80 / 64, packed a8 fp32 1.44 / 63, packed a8 bf16
1.69 / 63, dense bf16 0.85 / 64.  One decode token of linears: dense bf16 11.3 ms, packed 2.1 ms.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from engine.quant import blocks as qblocks, packing as qpacking, weights as qweights

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [  # name, N, K, GGUF qtype
    ("qkv", 960, HIDDEN, "Q4_1"),
    ("o", HIDDEN, HIDDEN, "Q4_1"),
    ("gate_up", 2 * INTER, HIDDEN, "Q4_1"),
    ("down", HIDDEN, INTER, "Q4_1"),
    ("lm_head", VOCAB, HIDDEN, "Q8_0"),
]


def _working_set_bytes() -> int:
    """Bytes of weights cycled through per shape: twice the last-level cache, at least 128 MiB.

    In a decode step the weights (and the KV cache) do not fit the cache; a fixed 128 MiB was
    beyond the AMD host's 32 MiB L3 but inside the Intel host's 260 MiB one, where it measured
    cache-resident speeds.
    """
    llc = 0
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip()
            llc = max(llc, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0))
        except (OSError, ValueError, IndexError):
            continue
    return max(128 << 20, 2 * llc)


WORKING_SET = _working_set_bytes()


def _random_blocks(qtype: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random valid GGUF blocks of any packed qtype (random bytes, small fp16 fields)."""
    bw, bb = qblocks.GGUF_BLOCKS[qtype]
    raw = torch.randint(0, 256, (n, k // bw, bb), dtype=torch.uint8, generator=gen)
    for i, at in enumerate(qblocks.FP16_AT[qtype]):
        sign = -1 if i and qtype.endswith("_1") else 1  # Q4_1 / Q5_1's offset m negative, as a real file's
        raw[..., at : at + 2] = (sign * torch.rand(n, k // bw, 1, generator=gen) * 0.01).half().view(torch.uint8)
    return raw.reshape(n, -1)


def best_time(fns: list[Callable[[], object]], trials: int = 7, min_trial_s: float = 0.02) -> float:
    """Seconds per call: best over trials of the mean over one pass through ``fns`` (repeated to
    at least ``min_trial_s``)."""
    for f in fns[: min(len(fns), 4)]:
        f()
    best = float("inf")
    for _ in range(trials):
        calls, t0 = 0, time.perf_counter()
        while True:
            for f in fns:
                f()
            calls += len(fns)
            el = time.perf_counter() - t0
            if el >= min_trial_s:
                break
        best = min(best, el / calls)
    return best


def kernel_table(ms: list[int], isa: str | None) -> dict[tuple[str, int], tuple[float, float]]:
    gen = torch.Generator().manual_seed(0)
    results = {}
    print(f"packed kernel path: {isa or qweights.available_isas()[-1]}; torch threads: {torch.get_num_threads()}")
    # The row-int8 copies on each fast path this CPU has (AVX-512 VNNI, AMX int8), side by side; with
    # --isa, on that path where it is a row-int8 one, else on the scalar reference.
    fast_rows = [r for r in qweights.rows_isas() if r != "scalar"]
    rows_isas = (fast_rows or ["scalar"]) if isa is None else [isa if isa in qweights.rows_isas() else "scalar"]
    print(f"row-int8 paths: {', '.join(rows_isas)}")
    print(f"{'shape':8s} {'N x K':>12s} {'M':>3s} | {'dense bf16':>10s} {'GB/s':>6s} | {'packed a16':>10s} {'GB/s':>6s} | "
          f"{'speedup':>7s} | {'packed a8':>9s} {'speedup':>7s} | "
          + " | ".join(f"{r[:9]:>9s} {'speedup':>7s} {'vs a8':>6s}" for r in rows_isas)
          + (f" | {rows_isas[-1][:4] + '/' + rows_isas[0][:4]:>9s}" if len(rows_isas) > 1 else ""))
    for name, n, k, qtype in SHAPES:
        dense_bytes = n * k * 2
        raw = _random_blocks(qtype, n, k, gen)
        packed0 = qweights.PackedWeight(qblocks.pack_blocks(raw, qtype, (n, k)), qtype, (n, k), isa, 16)
        w0 = qblocks.dequantize_blocks(raw, qtype, (n, k)).to(torch.bfloat16)
        n_dense = max(1, WORKING_SET // dense_bytes)
        n_packed = max(1, WORKING_SET // packed0.nbytes)
        dense = [w0] + [w0.clone() for _ in range(n_dense - 1)]
        packed = [packed0] + [qweights.PackedWeight(packed0.data.clone(), qtype, (n, k), isa, 16) for _ in range(n_packed - 1)]
        packed8 = [p.with_isa(isa, 8) for p in packed]
        rows0 = qweights.rows_int8_from(packed0)
        rows = [rows0] + [qweights.RowInt8Weight(rows0.data.clone(), rows0.scales, (n, k))
                          for _ in range(max(1, WORKING_SET // rows0.nbytes) - 1)]
        rows_by_isa = {ri: [qweights.RowInt8Weight(r.data, r.scales, (n, k), ri) for r in rows] for ri in rows_isas}
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            td = best_time([lambda w=w: F.linear(x, w) for w in dense])
            tp = best_time([lambda p=p: p(x) for p in packed])
            t8 = best_time([lambda p=p: p(x) for p in packed8])
            trs = [best_time([lambda r=r: r(x) for r in rows_by_isa[ri]]) for ri in rows_isas]
            results[(name, m)] = (td, tp)
            print(
                f"{name:8s} {f'{n}x{k}':>12s} {m:3d} | {td * 1e6:8.1f}us {dense_bytes / td / 1e9:6.1f} | "
                f"{tp * 1e6:8.1f}us {packed0.nbytes / tp / 1e9:6.1f} | {td / tp:6.2f}x | {t8 * 1e6:7.1f}us {td / t8:6.2f}x | "
                + " | ".join(f"{tr * 1e6:7.1f}us {td / tr:6.2f}x {t8 / tr:5.2f}x" for tr in trs)
                + (f" | {trs[0] / trs[-1]:8.2f}x" if len(trs) > 1 else "")
            )
        del dense, packed, packed8, rows, rows_by_isa
    return results


# Llama-3.2-1B's projections (hidden 2048, intermediate 8192, 32 heads / 8 kv heads of 64, 16 layers,
# vocab 128256), for --qtypes.
SHAPES_1B = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192), ("lm_head", 128256, 2048)]
LAYERS_1B = 16


def qtype_table(ms: list[int], qtypes: list[str], isa: str | None) -> None:
    """Per-projection time of the packed kernel at the 1B shapes for each block type, the bytes
    it reads and the GB/s that makes; and the sum over one token's projections (16 layers + the
    LM head in that type)."""
    gen = torch.Generator().manual_seed(0)
    print(f"\npacked kernels by block type at the 1B shapes (path {isa or qweights.available_isas()[-1]}, "
          f"{torch.get_num_threads()} threads)")
    print(f"{'qtype':6s} {'shape':8s} {'N x K':>13s} {'M':>3s} | {'time':>9s} {'MiB':>7s} {'bits/w':>6s} {'GB/s':>6s}")
    for m in ms:
        for qtype in qtypes:
            token = 0.0
            for name, n, k in SHAPES_1B:
                p0 = qweights.PackedWeight(qblocks.pack_blocks(_random_blocks(qtype, n, k, gen), qtype, (n, k)), qtype, (n, k), isa)
                copies = [p0] + [qweights.PackedWeight(p0.data.clone(), qtype, (n, k), isa) for _ in range(max(1, WORKING_SET // p0.nbytes) - 1)]
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
                t = best_time([lambda p=p: p(x) for p in copies], trials=5)
                token += t * (1 if name == "lm_head" else LAYERS_1B)
                print(f"{qtype:6s} {name:8s} {f'{n}x{k}':>13s} {m:3d} | {t * 1e6:7.1f}us {p0.nbytes / 2**20:7.1f} "
                      f"{8 * p0.nbytes / (n * k):6.2f} {p0.nbytes / t / 1e9:6.1f}")
                del copies, p0
            print(f"{qtype:6s} {'token':8s} {'':>13s} {m:3d} | {token * 1e3:7.2f}ms  (16 layers x 4 + lm_head)")


def _load_default_model(dtype: torch.dtype):
    from engine.loader import load_model

    return load_model("default", dtype)


def decode_token_linears(isa: str | None) -> None:
    """All linears of one batch-1 decode step with the real GGUF weights, in model order."""
    lm = _load_default_model(torch.bfloat16)
    g, w = lm.gguf_tensors, lm.weights
    seq_packed, seq_dense = [], []
    total_packed = total_dense = 0
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for parts in (
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            ["self_attn.o_proj"],
            ["mlp.gate_proj", "mlp.up_proj"],
            ["mlp.down_proj"],
        ):
            names = [f"{p}{s}.weight" for s in parts]
            pw = qpacking.pack_gguf([g[nm] for nm in names], isa)
            dw = torch.cat([w[nm] for nm in names]) if len(names) > 1 else w[names[0]]
            seq_packed.append(pw)
            seq_dense.append(dw)
            total_packed += pw.nbytes
            total_dense += dw.numel() * 2
    head = qpacking.pack_gguf([g["model.embed_tokens.weight"]], isa)
    seq_packed.append(head)
    seq_dense.append(w["model.embed_tokens.weight"])
    total_packed += head.nbytes
    total_dense += w["model.embed_tokens.weight"].numel() * 2
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for k in (HIDDEN, INTER)}

    def run_packed():
        for pw in seq_packed:
            pw(xs[pw.in_features])

    def run_dense():
        for dw in seq_dense:
            F.linear(xs[dw.shape[1]], dw)

    tp = best_time([run_packed], trials=10, min_trial_s=0.0)
    td = best_time([run_dense], trials=5, min_trial_s=0.0)
    print(
        f"\none decode token of linears (M=1, {LAYERS} layers x 4 + lm_head):\n"
        f"  dense bf16 : {td * 1e3:7.2f} ms  ({total_dense / 2**20:6.1f} MiB, {total_dense / td / 1e9:5.1f} GB/s)\n"
        f"  packed     : {tp * 1e3:7.2f} ms  ({total_packed / 2**20:6.1f} MiB, {total_packed / tp / 1e9:5.1f} GB/s)"
        f"  -> {td / tp:.1f}x"
    )


# ---------------------------------------------------------------- accuracy on the real model


class _Decoder:
    """Minimal float32 Llama decoder (batch 1, growing KV cache) whose linears are swappable."""

    def __init__(self, lm, linears: dict[str, Callable[[torch.Tensor], torch.Tensor]], act_dtype: torch.dtype) -> None:
        from engine.layers.fused import apply_rope_ref, rms_norm_ref
        from engine.models.llama import rope_cos_sin

        self.cfg, self.w, self.lin, self.dt = lm.config, lm.weights, linears, act_dtype
        self.cos_sin = rope_cos_sin(self.cfg, 512)
        self.rms, self.rope = rms_norm_ref, apply_rope_ref
        self.k: list[list[torch.Tensor]] = [[] for _ in range(self.cfg.num_hidden_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(self.cfg.num_hidden_layers)]

    def step(self, token: int, pos: int) -> torch.Tensor:
        c, w, dt = self.cfg, self.w, self.dt
        hd, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        x = w["model.embed_tokens.weight"][token][None].to(dt)
        positions = torch.tensor([pos])
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = self.rms(x, w[p + "input_layernorm.weight"].to(dt), c.rms_norm_eps)
            qkv = self.lin[p + "qkv"](h)
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q, k = self.rope(positions, q, k, self.cos_sin, hd)
            self.k[i].append(k.view(nkv, hd).float())
            self.v[i].append(v.view(nkv, hd).float())
            kk = torch.stack(self.k[i], 1).repeat_interleave(nh // nkv, 0)  # [nh, T, hd]
            vv = torch.stack(self.v[i], 1).repeat_interleave(nh // nkv, 0)
            att = torch.softmax((q.view(nh, 1, hd).float() @ kk.transpose(1, 2)) * hd**-0.5, -1) @ vv
            x = x + self.lin[p + "o"](att.reshape(1, nh * hd).to(dt))
            h = self.rms(x, w[p + "post_attention_layernorm.weight"].to(dt), c.rms_norm_eps)
            gu = self.lin[p + "gate_up"](h)
            x = x + self.lin[p + "down"](F.silu(gu[:, : c.intermediate_size]) * gu[:, c.intermediate_size :])
        x = self.rms(x, w["model.norm.weight"].to(dt), c.rms_norm_eps)
        return self.lin["lm_head"](x).float()[0]


def _linears(lm, packed: bool, dt: torch.dtype, isa: str | None, act_bits: int = 16) -> dict[str, Callable]:
    out: dict[str, Callable] = {}
    g, w = lm.gguf_tensors, lm.weights
    groups = {
        "qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "o": ["self_attn.o_proj"],
        "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
        "down": ["mlp.down_proj"],
    }
    for i in range(lm.config.num_hidden_layers):
        p = f"model.layers.{i}."
        for key, parts in groups.items():
            names = [f"{p}{s}.weight" for s in parts]
            if packed:
                out[p + key] = qpacking.pack_gguf([g[n] for n in names], isa, act_bits)
            else:
                dw = torch.cat([w[n] for n in names]).to(dt)
                out[p + key] = lambda x, dw=dw: F.linear(x, dw)
    head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
    if packed:
        out["lm_head"] = qpacking.pack_gguf([g[head]], isa, act_bits)
    else:
        hw = w[head].to(dt)
        out["lm_head"] = lambda x: F.linear(x, hw)
    return out


def accuracy(steps: int, isa: str | None) -> None:
    """Decode ``steps`` greedy tokens with the dense float32 model (the reference: the dequantized
    GGUF) and, fed the same tokens, with packed linears (16- and 8-bit kernel activations, float32
    and bf16 models) and with a dense bf16 model; report the logit differences and the
    greedy-token agreement."""
    lm = _load_default_model(torch.float32)
    tok = lm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Explain why the sky is blue in three sentences."}])
    ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
    variants = {
        f"packed a{bits}, {name} model": _Decoder(lm, _linears(lm, True, dt, isa, bits), dt)
        for bits in (16, 8)
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    variants["dense, bf16 model"] = _Decoder(lm, _linears(lm, False, torch.bfloat16, isa), torch.bfloat16)
    ref = _Decoder(lm, _linears(lm, False, torch.float32, isa), torch.float32)
    stats = {k: {"maxdiff": [], "agree": 0, "free": None} for k in variants}
    free_tokens = {k: [] for k in variants}
    generated: list[int] = []
    scale: list[tuple[float, float]] = []  # (std, top-1 minus top-2) of the reference logits per step
    with torch.inference_mode():
        pos = 0
        for t in ids[:-1]:
            ref.step(t, pos)
            for d in variants.values():
                d.step(t, pos)
            pos += 1
        cur = ids[-1]
        for _ in range(steps):
            r = ref.step(cur, pos)
            nxt = int(r.argmax())
            top2 = r.topk(2).values
            scale.append((r.std().item(), (top2[0] - top2[1]).item()))
            for name, d in variants.items():
                o = d.step(cur, pos)
                stats[name]["maxdiff"].append((o - r).abs().max().item())
                stats[name]["agree"] += int(int(o.argmax()) == nxt)
                free_tokens[name].append(int(o.argmax()))
            generated.append(nxt)
            cur, pos = nxt, pos + 1
    print(f"\naccuracy vs dense float32 over {steps} greedy decode steps (teacher-forced on the reference tokens):")
    print(f"reference text: {tok.decode(generated)!r}")
    print(
        f"reference logits: std {statistics.median(s for s, _ in scale):.2f}, top-1 minus top-2 margin "
        f"median {statistics.median(m for _, m in scale):.2f}, min {min(m for _, m in scale):.3f}"
    )
    for name, s in stats.items():
        md = s["maxdiff"]
        print(
            f"  {name:22s}: max |logit diff| {max(md):.4f} (median per step {statistics.median(md):.4f}); "
            f"greedy token agreement {s['agree']}/{steps}"
        )


# ---------------------------------------------------------------- fused element-wise ops


def fused_ops(t: int = 1) -> None:
    from engine.layers import fused
    from engine.models.llama import rope_cos_sin  # noqa: F401  (same cache layout)

    dt = torch.bfloat16
    x = torch.randn(t, HIDDEN, dtype=dt)
    res = torch.randn(t, HIDDEN, dtype=dt)
    w = torch.rand(HIDDEN, dtype=dt)
    gu = torch.randn(t, 2 * INTER, dtype=dt)
    qkv = torch.randn(t, 960, dtype=dt)
    q, k, _ = qkv.split([576, 192, 192], dim=-1)
    pos = torch.arange(t, dtype=torch.int64) + 100
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    f = torch.outer(torch.arange(2048).float(), inv)
    cs = torch.cat((f.cos(), f.sin()), -1)
    cases = [
        ("add_rms_norm", lambda: fused.add_rms_norm_ref(x, res, w, 1e-5), lambda: fused.add_rms_norm(x, res, w, 1e-5)),
        ("add_rms_norm_ (in place)", None, lambda: fused.add_rms_norm_(x, res, w, 1e-5)),
        ("silu_and_mul", lambda: fused.silu_and_mul_ref(gu), lambda: fused.silu_and_mul(gu)),
        ("apply_rope", lambda: fused.apply_rope_ref(pos, q, k, cs, 64), lambda: fused.apply_rope(pos, q, k, cs, 64)),
        ("apply_rope_ (in place)", None, lambda: fused.apply_rope_(pos, q, k, cs, 64)),
    ]
    print(f"\nfused element-wise ops, bf16, {t} token(s): torch reference vs native (us per call)")
    per_layer_ref = per_layer_nat = 0.0
    for name, ref, nat in cases:
        tn = best_time([nat], min_trial_s=0.01) * 1e6
        tr = best_time([ref], min_trial_s=0.01) * 1e6 if ref else float("nan")
        print(f"  {name:26s} torch {tr:7.1f}   native {tn:6.1f}")
    # per layer: 2 norms + silu + rope
    per_layer_ref = 2 * best_time([cases[0][1]]) + best_time([cases[2][1]]) + best_time([cases[3][1]])
    per_layer_nat = 2 * best_time([cases[1][2]]) + best_time([cases[2][2]]) + best_time([cases[4][2]])
    print(f"  per token ({LAYERS} layers): torch {per_layer_ref * LAYERS * 1e3:.2f} ms, native {per_layer_nat * LAYERS * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="*", default=[1, 4, 16, 64], help="activation rows")
    ap.add_argument("--isa", default=None, help=f"pin the packed path ({', '.join(qweights.ISA_NAMES.values())})")
    ap.add_argument("--accuracy", action="store_true", help="also measure activation-quantization accuracy")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--fused", action="store_true", help="also time the fused element-wise ops")
    ap.add_argument("--no-table", action="store_true", help="skip the kernel table and decode total")
    ap.add_argument("--qtypes", nargs="*", default=None, metavar="QTYPE",
                    help=f"time these block types at the 1B shapes instead ({', '.join(qblocks.QTYPE_IDS)})")
    args = ap.parse_args()
    if not qweights.native_available():
        raise SystemExit("native extension unavailable: nothing to benchmark")
    if args.qtypes:
        qtype_table(args.m, args.qtypes, args.isa)
    elif not args.no_table:
        kernel_table(args.m, args.isa)
        decode_token_linears(args.isa)
    if args.fused:
        fused_ops(1)
    if args.accuracy:
        accuracy(args.steps, args.isa)


if __name__ == "__main__":
    main()
