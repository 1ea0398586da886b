"""Small helpers shared by the e2e tests."""

from __future__ import annotations

import time
from typing import Callable, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "e2e-secret-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
MAX_REQUEST_BYTES = 64 * 1024


def scrape(base_url: str) -> dict[tuple[str, frozenset], float]:
    """GET /metrics (no key needed) -> {(sample name, labels): value}."""
    r = httpx.get(base_url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(samples: dict, name: str, absent: Optional[float] = None, **labels: str) -> float:
    """One sample's value; labels not given are summed over (model_name is always ours).  A series
    that does not exist yet fails, or reads ``absent`` when given (a labelled counter appears with
    its first event)."""
    want = {"model_name": MODEL, **labels}
    total, found = 0.0, False
    for (n, lbls), v in samples.items():
        d = dict(lbls)
        if n == name and all(d.get(k) == val for k, val in want.items()):
            total += v
            found = True
    if not found and absent is not None:
        return absent
    assert found, f"no sample {name}{want} in /metrics"
    return total


def wait_for(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def sse_events(lines) -> list:  # noqa: ANN001
    """Parse `data: ...` lines of an SSE body into JSON objects (and the final '[DONE]' string)."""
    import json

    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
