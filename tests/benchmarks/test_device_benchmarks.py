"""The tools for measuring where the model cannot travel (the device machine):

* benchmarks/random_gguf.py: a small header travels, the full random-weight copy is written from
  it, and the engine serves the copy like the original (same tokenizer, shapes and tensor types);
* benchmarks/scaling.py: the engine alone across thread counts, as a table of ratios.
"""

from __future__ import annotations

import gguf
import pytest

from benchmarks import random_gguf, scaling
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from tests.tiny_models import make_tiny_gguf


def tensor_list(path: str) -> list[tuple[str, str, list[int]]]:
    return [(t.name, t.tensor_type.name, t.shape.tolist()) for t in gguf.GGUFReader(path).tensors]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_copy_keeps_metadata_types_and_shapes(tmp_path, qtype):
    original = make_tiny_gguf(tmp_path, "llama", qtype)
    header, copy = tmp_path / "header.gguf", tmp_path / "copy.gguf"
    random_gguf.main(["header", "--model", str(original), str(header)])
    assert tensor_list(str(header)) == []
    assert header.stat().st_size < original.stat().st_size
    random_gguf.main(["fill", str(header), str(copy)])

    assert tensor_list(str(copy)) == tensor_list(str(original))
    a, b = gguf.GGUFReader(str(original)), gguf.GGUFReader(str(copy))
    assert random_gguf.TENSORS_KEY not in b.fields
    for key in ("general.architecture", "llama.block_count", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.chat_template"):
        assert b.fields[key].contents() == a.fields[key].contents(), key
    differs = [t.name for t, u in zip(a.tensors, b.tensors) if bytes(t.data) != bytes(u.data)]
    assert "blk.0.attn_q.weight" in differs  # random contents, not a copy


def test_engine_serves_the_copy(tmp_path):
    header, copy = tmp_path / "header.gguf", tmp_path / "copy.gguf"
    random_gguf.main(["header", "--model", str(make_tiny_gguf(tmp_path, "llama", "Q4_1")), str(header)])
    random_gguf.main(["fill", str(header), str(copy)])
    llm = LLM(config=EngineConfig(model=str(copy), num_threads=1))
    out = llm.generate(["the the"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8
    assert all(0 <= t < llm.engine.model_config.vocab_size for t in out.token_ids)


def test_fill_refuses_a_file_without_a_tensor_list(tmp_path):
    with pytest.raises(SystemExit, match="no tensor list"):
        random_gguf.main(["fill", str(make_tiny_gguf(tmp_path, "llama", "Q8_0")), str(tmp_path / "x.gguf")])


def test_scaling_prints_one_row_per_thread_count(tmp_path, capsys):
    model = make_tiny_gguf(tmp_path, "llama", "Q4_1")
    args = ["--model", str(model), "--threads", "1,2", "--streams", "2", "--requests", "4", "--requests-1", "1",
            "--input-len", "8", "--output-len", "4"]
    assert scaling.main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 2"]
    assert rows[0].split(" | ")[2] == "1.00x" and rows[0].endswith("| 1.00x |")
    assert all(float(row.split(" | ")[1]) > 0 and float(row.split(" | ")[3]) > 0 for row in rows)
