"""``--weight-quant <type>`` on a Hugging Face directory, through the real server: every projection
is quantized at load to the asked type and served by the packed kernels, the start-up log says so
(lossy), and completions come back."""

from __future__ import annotations

import re

import httpx
import pytest

from engine.quant import weights as qweights
from tests.tiny_models import make_tiny_hf_model

from .conftest import start_server

pytestmark = pytest.mark.skipif(not qweights.native_available(), reason="no native extension: nothing is packed")


@pytest.mark.parametrize("weight_quant", ["q4_0", "q5_1"])
def test_hf_directory_served_quantized(tmp_path, weight_quant: str) -> None:
    model = make_tiny_hf_model(tmp_path, "llama", seed=5)
    srv = start_server(f"wq-{weight_quant}", tmp_path, "--model", str(model), "--weight-quant", weight_quant,
                       "--kv-cache-gb", "0.05", "--threads", "1", "--max-model-len", "256")
    try:
        name = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(srv.url + "/v1/completions", timeout=120,
                       json={"model": name, "prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        log = srv.log_tail(20000)
        m = re.search(r"packed weights: 0 from the file, (\d+) quantized to (\w+) at load \(lossy\), 0 dense", log)
        assert m is not None, log
        assert int(m.group(1)) >= 5 and m.group(2) == weight_quant.upper()  # the layer's projections and the LM head
    finally:
        srv.stop()


@pytest.mark.parametrize("qtype", ["IQ4_XS", "IQ4_NL", "Q3_K", "Q2_K", "IQ3_S", "IQ3_XXS"])
def test_gguf_types_served_from_their_blocks(tmp_path, qtype: str) -> None:
    """A GGUF file of each type the packed kernels took on last (IQ4_XS / IQ4_NL / IQ3_S / IQ3_XXS were refused at
    load, Q3_K and Q2_K ran dense) loads with every projection in its blocks, says so in the start-up log, and
    serves completions and streams."""
    from tests.tiny_models import make_tiny_gguf

    model = make_tiny_gguf(tmp_path, "llama", qtype, seed=3)
    srv = start_server(f"gguf-{qtype}", tmp_path, "--model", str(model), "--kv-cache-gb", "0.05", "--threads", "1",
                       "--max-model-len", "256")
    try:
        name = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": name, "prompt": "the hat", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json=body | {"stream": True}) as s:
            text = "".join(line for line in s.iter_lines())
        assert s.status_code == 200 and "[DONE]" in text
        log = srv.log_tail(20000)
        m = re.search(r"packed weights: (\d+) from the file, 0 quantized to \S+ at load \(lossy\), 0 dense", log)
        assert m is not None, log
        assert int(m.group(1)) == 9  # each of the two layers' qkv, o, gate_up and down, and the LM head
    finally:
        srv.stop()
