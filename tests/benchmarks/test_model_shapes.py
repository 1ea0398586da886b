"""Tests for the pure pieces of the per-shape benchmark (benchmarks/model_shapes.py, compare.py's
--model mode) and the per-type quality table (benchmarks/quality_types.py).

No peers and no generated models: model directories are made here from empty files and tiny GGUFs
written with the ``gguf`` package; compare.py runs against the fake server of test_bench_serve.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from unittest import mock

import numpy as np
import pytest
import torch

from benchmarks import model_shapes as shapes
from benchmarks import quality_types as qt
from tests import ROOT


def _model_dir(tmp_path, types=("q4_k_m", "q8_0"), hf=True):  # noqa: ANN001
    d = tmp_path / "llama-3.2-1b"
    d.mkdir()
    for t in types:
        (d / f"{t}.gguf").write_bytes(b"")
    if hf:
        (d / "hf").mkdir()
        (d / "hf" / "config.json").write_text("{}")
    return d


# ------------------------------------------------------------------------------------------------
# Model files
# ------------------------------------------------------------------------------------------------


def test_resolve_model_picks_the_type_and_the_hf_dir(tmp_path):
    d = _model_dir(tmp_path)
    m = shapes.resolve_model(str(d), "Q8_0")
    assert m.gguf == str(d / "q8_0.gguf") and m.hf_dir == str(d / "hf")
    assert m.name == "llama-3.2-1b" and m.gguf_type == "q8_0"
    assert shapes.resolve_model(str(d) + "/").name == "llama-3.2-1b"  # trailing slash: same name
    assert shapes.resolve_model(str(d)).gguf_type == "q4_k_m"  # the default type


def test_resolve_model_names_the_types_there_are(tmp_path):
    d = _model_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="has: q4_k_m, q8_0"):
        shapes.resolve_model(str(d), "q6_k")
    assert shapes.gguf_types(str(d)) == ["q4_k_m", "q8_0"]
    assert shapes.gguf_types(str(tmp_path / "nowhere")) == []


def test_explicit_files_win_over_the_directory(tmp_path):
    d = _model_dir(tmp_path, hf=False)
    other = tmp_path / "Q5_K_M.gguf"
    other.write_bytes(b"")
    hf = tmp_path / "myhf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    m = shapes.resolve_model(str(d), "q4_k_m", gguf=str(other), hf_dir=str(hf))
    assert m.gguf == str(other) and m.gguf_type == "q5_k_m" and m.hf_dir == str(hf) and m.name == "llama-3.2-1b"
    assert shapes.resolve_model(str(d)).hf_dir is None  # no hf/ there: vLLM converts the GGUF instead
    m = shapes.resolve_model(gguf=str(other), hf_dir=str(hf))
    assert m.name == "q5_k_m"
    with pytest.raises(FileNotFoundError, match="config.json"):
        shapes.resolve_model(str(d), hf_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError):
        shapes.resolve_model(gguf=str(tmp_path / "missing.gguf"))


# ------------------------------------------------------------------------------------------------
# Bytes a token, bandwidth, floor
# ------------------------------------------------------------------------------------------------


def _tensors(tied: bool) -> list[shapes.TensorInfo]:
    ts = [shapes.TensorInfo("token_embd.weight", 1000, 4000), shapes.TensorInfo("blk.0.attn_q.weight", 300, 1200),
          shapes.TensorInfo("blk.0.attn_norm.weight", 16, 4), shapes.TensorInfo("output_norm.weight", 16, 4)]
    if not tied:
        ts.append(shapes.TensorInfo("output.weight", 900, 4000))
    return ts


def test_weight_read_bytes_counts_the_embedding_only_when_it_is_the_lm_head():
    assert shapes.weight_read_bytes(_tensors(tied=True)) == 1000 + 300 + 16 + 16
    assert shapes.weight_read_bytes(_tensors(tied=False)) == 300 + 16 + 16 + 900  # embedding: one row looked up
    assert shapes.weight_read_bytes(_tensors(tied=True), bytes_per_element=2) == 2 * (4000 + 1200 + 4 + 4)


def test_read_tensor_infos_from_a_real_gguf(tmp_path):
    """Stored bytes come from the file's tensor types: Q8_0 is 34 bytes a 32-block, F32 4 a weight."""
    import gguf

    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    q = gguf.quants.quantize(np.ones((64, 256), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    infos = {t.name: t for t in shapes.read_tensor_infos(path)}
    assert infos["token_embd.weight"].n_bytes == 64 * 256 // 32 * 34 and infos["token_embd.weight"].n_elements == 64 * 256
    assert infos["output_norm.weight"].n_bytes == 256 * 4
    assert shapes.weight_read_bytes(infos.values()) == 64 * 256 // 32 * 34 + 1024
    assert qt.bits_per_weight(path) == pytest.approx(8 * (64 * 8 * 34 + 1024) / (64 * 256 + 256))


def test_decode_floor_arithmetic():
    assert shapes.decode_floor_ms(500e6, 25e9) == pytest.approx(20.0)
    with pytest.raises(ValueError):
        shapes.decode_floor_ms(1.0, 0.0)


def test_floor_lines_put_each_engine_against_its_own_floor():
    lines = shapes.floor_lines(600_000_000, 2_000_000_000, 20e9, "q4_k_m",
                               {"ours": 45.0, "vLLM-CPU": 150.0, "llama.cpp": None})
    assert "600 MB of q4_k_m weights a token (bf16: 2000 MB) / 20.0 GB/s" in lines[0]
    assert "= 30.00 ms (q4_k_m), 100.00 ms (bf16)" in lines[0]
    assert lines[1] == "- ours c=1 TPOT p50 45.00 ms = 1.50 x its floor (q4_k_m, 30.00 ms)"
    assert lines[2] == "- vLLM-CPU c=1 TPOT p50 150.00 ms = 1.50 x its floor (bf16, 100.00 ms)"
    assert len(lines) == 3  # no TPOT, no line


def test_read_bandwidth_is_a_rate_over_the_buffer():
    bw = shapes.measure_read_bandwidth(threads=1, size_mb=16, repeats=2)
    assert 1e8 < bw < 1e13  # bytes/s: somewhere between a slow disk and beyond any memory bus


# ------------------------------------------------------------------------------------------------
# compare.py --model
# ------------------------------------------------------------------------------------------------


def test_compare_model_mode_defaults(tmp_path):
    from benchmarks import compare
    from benchmarks.compare_workloads import parse_workloads

    d = _model_dir(tmp_path)
    a = compare.parse_args(["--model", str(d), "--gguf-type", "q8_0"])
    assert a.gguf == str(d / "q8_0.gguf") and a.hf_dir == str(d / "hf") and a.served_name == "llama-3.2-1b"
    assert a.workloads == "c1,c16,long2" and a.floor
    assert [(w.input_len, w.output_len, w.concurrency) for w in parse_workloads(a.workloads)] == \
        [(128, 128, 1), (128, 128, 16), (1024, 32, 2)]
    a = compare.parse_args([])  # the bundled model: as before
    assert a.served_name == "smollm2" and a.workloads == "c1,c16,c32,long" and not a.floor and a.hf_dir is None
    with pytest.raises(SystemExit):
        compare.parse_args(["--model", str(d), "--gguf-type", "q2_k"])


def test_compare_hf_type_serves_ours_from_the_hf_directory(tmp_path):
    """--gguf-type hf: ours runs the hf/ directory vLLM-CPU runs (dense bf16), its floor is the bf16 one,
    and llama-server, which reads GGUF files only, is refused up front."""
    from benchmarks import compare
    from benchmarks.compare_engines import start_ours

    d = _model_dir(tmp_path, types=("q4_k_m", "f16"))
    a = compare.parse_args(["--model", str(d), "--gguf-type", "hf", "--peers", "vllm"])
    assert a.ours_model == str(d / "hf") and a.gguf == str(d / "f16.gguf") and a.gguf_type == "bf16"
    assert compare.parse_args(["--model", str(d)]).ours_model == str(d / "q4_k_m.gguf")
    with pytest.raises(SystemExit):
        compare.parse_args(["--model", str(d), "--gguf-type", "hf", "--peers", "llama"])
    started = []
    with mock.patch("benchmarks.harness.launch", lambda name, cmd, *rest, **kw: started.append(cmd)):
        start_ours(a, 1234)
    assert started[0][started[0].index("--model") + 1] == str(d / "hf")
    lines = shapes.floor_lines(2_000_000, 2_000_000, 1e9, "bf16", {"ours": 4.0})
    assert lines[1].endswith("(bf16, 2.00 ms)")


def test_compare_model_mode_end_to_end_with_fake_server(tmp_path):
    """--model: the fake server as ours, started under the directory's name, and the floor under the table."""
    from tokenizers import ByteLevelBPETokenizer

    from benchmarks import compare
    from benchmarks.harness import process_tree
    from tests.benchmarks.test_bench_serve import _cmdline

    d = _model_dir(tmp_path, types=())
    test_read_tensor_infos_from_a_real_gguf(tmp_path)  # writes tmp_path/t.gguf
    os.replace(tmp_path / "t.gguf", d / "q8_0.gguf")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300, min_frequency=1)
    tok.save(str(d / "hf" / "tokenizer.json"))  # the prompts' tokenizer: the HF directory's
    fake = ROOT / "tests" / "benchmarks" / "test_bench_serve.py"
    out = tmp_path / "cmp.json"
    old = signal.getsignal(signal.SIGTERM)
    try:
        rc = compare.main(["--model", str(d), "--gguf-type", "q8_0", "--workloads", "32:8:1", "--num-prompts", "2",
                           "--warmup", "0", "--idle-wait", "0.1", "--bandwidth-mb", "16", "--log-dir", str(tmp_path), "--json-out", str(out),
                           "--ours-cmd", f"{sys.executable} {fake} --fake-server --port {{port}} "
                                         "--served-model-name {model}"])
    finally:
        signal.signal(signal.SIGTERM, old)
    assert rc == 0
    assert not [p for p in process_tree(os.getpid()) if b"--fake-server" in _cmdline(p)]
    rep = json.loads(out.read_text())
    ours = rep["engines"]["ours"]
    assert "llama-3.2-1b" in ours["cmd"] and ours["workloads"]["32x8c1"]["completed"] == 2
    assert ours["startup_s"] > 0 and ours["idle_rss_mb"] > 5 and ours["peak_rss_mb"] > 0
    floor = rep["floor"]
    assert floor["bytes_gguf"] == 64 * 8 * 34 + 1024 and floor["bandwidth_bytes_s"] > 0
    assert "Batch-1 decode floor:" in rep["table"] and "- ours c=1 TPOT p50 " in rep["table"]


# ------------------------------------------------------------------------------------------------
# quality_types.py
# ------------------------------------------------------------------------------------------------


def test_type_files_and_the_quantize_command(tmp_path):
    src = "/x/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert qt.source_stem(src) == "SmolLM2-135M-Instruct"
    assert qt.source_stem("/x/model.gguf") == "model"
    assert qt.type_path(str(tmp_path), src, "q4_k_m") == str(tmp_path / "SmolLM2-135M-Instruct.Q4_K_M.gguf")
    assert qt.quantize_command("llama-quantize", src, "/o.gguf", "q6_k", 2) == \
        ["llama-quantize", "--allow-requantize", src, "/o.gguf", "Q6_K", "2"]
    made = tmp_path / "SmolLM2-135M-Instruct.Q8_0.gguf"
    made.write_bytes(b"x")
    # already in the cache: no llama-quantize needed
    assert qt.ensure_type_file(str(tmp_path), src, "q8_0", "/no/such/llama-quantize") == str(made)
    with pytest.raises(SystemExit, match="llama-quantize"):
        qt.ensure_type_file(str(tmp_path), src, "q4_0", "/no/such/llama-quantize")


def test_windows_open_with_bos_and_drop_a_short_tail():
    ids = list(range(10, 30))  # 20 text tokens
    w = qt.windows(ids, window=6, total=20, bos=1)
    assert w == [[1, 10, 11, 12, 13, 14], [1, 15, 16, 17, 18, 19], [1, 20, 21, 22, 23, 24], [1, 25, 26, 27, 28, 29]]
    assert qt.windows(ids, window=8, total=16, bos=None) == [ids[:8], ids[8:16]]
    assert qt.windows(ids, window=8, total=18, bos=None) == [ids[:8], ids[8:16]]  # 2-token tail: dropped
    assert qt.windows(ids, window=8, total=20, bos=None)[-1] == ids[16:20]  # half a window: kept


def test_kld_and_top1_against_hand_computed_values():
    ref = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]]), -1)
    same = qt.kld_stats(ref, ref.clone())
    assert same["kld_sum"] == pytest.approx(0.0, abs=1e-6) and same["top1_same"] == 2 and same["positions"] == 2
    other = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 3.0]])
    s = qt.kld_stats(ref, other)
    p, q = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0), torch.softmax(torch.tensor([1.0, 2.0, 0.0]), 0)
    kl = float((p * (p / q).log()).sum())
    assert s["kld_sum"] == pytest.approx(kl, rel=1e-5) and s["kld_max"] == pytest.approx(kl, rel=1e-5)
    assert s["top1_same"] == 1
    pooled = qt.pool([s, same])
    assert pooled["positions"] == 4 and pooled["mean_kld"] == pytest.approx(kl / 4, rel=1e-5)
    assert pooled["top1"] == 0.75 and math.isclose(pooled["max_kld"], s["kld_max"])


def test_kld_table_has_a_column_pair_per_kv_dtype_and_the_published_figures():
    res = {"mean_kld": 0.01234, "max_kld": 1.0, "top1": 0.9512, "positions": 100}
    rows = [{"label": "Q4_K_M", "key": "q4_k_m", "bpw": 4.891, "results": {"auto": res}},
            {"label": "bf16 dense", "key": "bf16", "bpw": 16.0, "results": {"auto": res, "bfloat16": res}}]
    table = qt.kld_table(rows, {"auto": "auto (int8)", "bfloat16": "bfloat16"})
    lines = table.splitlines()
    assert lines[0] == ("| weights | bits/weight | KV auto (int8): mean KLD | KV auto (int8): top-1 | "
                        "KV bfloat16: mean KLD | KV bfloat16: top-1 | llama.cpp published: mean KLD / top-1 |")
    assert lines[2] == "| Q4_K_M | 4.89 | 0.0123 | 95.1% | n/a | n/a | 0.0127 / 94.7% (L2 7B); 0.0313 / 91.9% (L3 8B) |"
    assert lines[3].endswith("| 0.0123 | 95.1% | 0.0123 | 95.1% | - |")
    assert qt.published_text("q5_k_m") == "0.0108 (L3 8B)"
