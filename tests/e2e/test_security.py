"""Security properties: the API key on every route but /health and /metrics, compared in constant
time; no prompt or key in the logs at the default level; a loopback default bind; no pickle.

(The container's non-root user is checked in tests/deploy/test_dockerfile.py.)
"""

from __future__ import annotations

import ast
import inspect
import re

import httpx

from benchmarks.harness import ServerProcess
from service import __main__ as cli
from service import middleware

from .conftest import ROOT
from .helpers import API_KEY, MODEL, wait_for

PROMPT_CANARY = "zebra-canary-7f3a91 secret prompt text"
KEY_CANARY = "sk-canary-0d5e2b9c"


def test_every_route_but_health_and_metrics_needs_the_key(server: ServerProcess) -> None:
    spec = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    routes = [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops] + [("GET", "/docs"), ("GET", "/openapi.json")]
    assert ("POST", "/v1/completions") in routes and ("POST", "/detokenize") in routes
    wrong = [{}, {"Authorization": "Bearer " + API_KEY[:-1]}, {"Authorization": "Bearer " + API_KEY + "x"},
             {"Authorization": API_KEY}, {"Authorization": "Basic " + API_KEY}, {"Authorization": f"Bearer {KEY_CANARY}"}]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for method, path in routes + [("GET", "/v1/no-such-route"), ("DELETE", "/v1/completions")]:
            for headers in wrong:
                r = c.request(method, path, headers=headers, json={"model": MODEL, "prompt": "x"})
                if path in ("/health", "/metrics"):
                    assert r.status_code == 200, (method, path)
                else:
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                    assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200  # scheme is case-insensitive


def test_key_is_compared_in_constant_time() -> None:
    source = inspect.getsource(middleware.GateMiddleware._authorized)
    assert "hmac.compare_digest" in source
    assert not re.search(r"==\s*self\._key|self\._key\s*==", source)


def test_prompts_and_keys_never_reach_the_log(server: ServerProcess) -> None:
    """At the default level (info): a served request, a refused one, a streamed one, a wrong key."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post("/v1/completions", headers=auth, json={"model": MODEL, "prompt": PROMPT_CANARY, "max_tokens": 2}).status_code == 200
        chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT_CANARY}], "max_tokens": 2, "stream": True}
        with c.stream("POST", "/v1/chat/completions", headers=auth, json=chat) as r:
            assert r.status_code == 200
            r.read()
        bad = c.post("/v1/completions", headers=auth, json={"model": MODEL, "prompt": PROMPT_CANARY, "max_tokens": -1})
        assert bad.status_code == 400
        assert c.post("/tokenize", headers=auth, json={"prompt": PROMPT_CANARY}).status_code == 200
        assert c.post("/v1/completions", headers={"Authorization": f"Bearer {KEY_CANARY}"},
                      json={"model": MODEL, "prompt": PROMPT_CANARY}).status_code == 401
    wait_for(lambda: "chatcmpl-" in server.log(), 10, "the request log lines")
    log = server.log()
    assert "--log-level" not in " ".join(server.proc.args)  # the default level
    for secret in (PROMPT_CANARY, "zebra-canary", KEY_CANARY, API_KEY):
        assert secret not in log, f"{secret!r} is in the server log"


def test_default_bind_address_is_loopback() -> None:
    args = cli.build_parser(env={}).parse_args([])
    assert args.host == "127.0.0.1"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r'ENTRYPOINT \[.*"--host", "0\.0\.0\.0"', dockerfile), "the container binds 0.0.0.0 explicitly"


def test_weights_are_never_unpickled() -> None:
    """No pickle anywhere the server loads or serves from: no torch.load, pickle, np.load(allow_pickle)."""
    offenders = []
    for path in sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "service").rglob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                if any(n.split(".")[0] in ("pickle", "cPickle", "dill", "joblib", "cloudpickle") for n in names):
                    offenders.append(f"{path}:{node.lineno} imports {names}")
            if isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                if func.endswith(("torch.load", "pickle.load", "pickle.loads")):
                    offenders.append(f"{path}:{node.lineno} calls {func}")
                if any(k.arg in ("allow_pickle", "weights_only") and ast.unparse(k.value) != ("False" if k.arg == "allow_pickle" else "True")
                       for k in node.keywords):
                    offenders.append(f"{path}:{node.lineno} {ast.unparse(node)[:80]}")
    assert not offenders, offenders
