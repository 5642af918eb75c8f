"""LoRA over HTTP, in process: adapters as models (``/v1/models``, ``model=``), unknown model ->
404 in OpenAI's shape, and the runtime load / unload endpoints: off unless enabled, then only
from the allowed folders (outside, through a symlink or with '..' -> 400)."""
from __future__ import annotations

import os

import pytest
from starlette.testclient import TestClient

from specdec import LLM, LoRARequest, SamplingParams
from specdec.server.app import ServerSettings, build_app
from tests.lora.conftest import write_adapter

PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def llm(llama_path) -> LLM:
    return LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=128, enable_lora=True, max_loras=2,
               max_lora_rank=8, num_threads=1)


@pytest.fixture(scope="module")
def allowed(tmp_path_factory, llama_path):
    root = tmp_path_factory.mktemp("allowed")
    write_adapter(root / "good", llama_path, seed=5)
    write_adapter(root / "big", llama_path, rank=16, seed=6)
    outside = write_adapter(tmp_path_factory.mktemp("outside") / "evil", llama_path, seed=7)
    os.symlink(outside, root / "link")
    return root, outside


@pytest.fixture(scope="module")
def expected(llm, adapters) -> dict[str, str]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = {"tiny": llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text}
    for i, name in enumerate(("all", "qv")):
        lora = LoRARequest(name, 100 + i, adapters[name])
        out[name] = llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    return out


@pytest.fixture(scope="module")
def client(llm, adapters, allowed, expected):
    settings = ServerSettings(model_name="tiny", lora_modules=[("all", adapters["all"]), ("qv", adapters["qv"])],
                              enable_lora_runtime_updates=True, lora_allowed_dirs=[str(allowed[0])])
    with TestClient(build_app(llm.engine, settings)) as c:
        yield c


def _complete(client, model: str):
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True})


def test_adapters_are_models(client, expected):
    cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert set(cards) == {"tiny", "all", "qv"}
    assert cards["all"]["parent"] == "tiny" and cards["tiny"]["parent"] is None
    texts = {name: _complete(client, name).json()["choices"][0]["text"] for name in ("tiny", "all", "qv")}
    assert texts == expected
    assert len(set(texts.values())) == 3  # each adapter changes the output
    chat = client.post("/v1/chat/completions", json={"model": "all", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 4})
    assert chat.status_code in (200, 400)  # the tiny tokenizer may have no chat template; never a 5xx
    assert chat.json()["model" if chat.status_code == 200 else "error"]


def test_unknown_model_is_404(client):
    r = _complete(client, "nope")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "'nope'" in error["message"]


def test_runtime_load_and_unload(client, allowed):
    root, outside = allowed
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": str(root / "good")})
    assert r.status_code == 200, r.text
    assert "good" in {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert _complete(client, "good").status_code == 200
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": str(root / "good")})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "good"}).status_code == 200
    assert _complete(client, "good").status_code == 404
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "good"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize("case", ["outside", "symlink out", "dotdot", "rank", "not json", "missing"])
def test_runtime_load_refusals(client, allowed, case):
    root, outside = allowed
    body = {"outside": {"lora_name": "x", "lora_path": outside},
            "symlink out": {"lora_name": "x", "lora_path": str(root / "link")},
            "dotdot": {"lora_name": "x", "lora_path": f"{root}/good/../good"},
            "rank": {"lora_name": "x", "lora_path": str(root / "big")},
            "missing": {"lora_name": "x", "lora_path": str(root / "absent")},
            "not json": None}[case]
    r = client.post("/v1/load_lora_adapter", json=body) if body is not None else \
        client.post("/v1/load_lora_adapter", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    expected = {"outside": "--lora-allowed-dir", "symlink out": "--lora-allowed-dir", "dotdot": "'..'",
                "rank": "over max_lora_rank 8", "missing": "not a folder", "not json": "JSON object"}[case]
    assert expected in message
    assert "x" not in {m["id"] for m in client.get("/v1/models").json()["data"]}


def test_runtime_updates_are_off_by_default(llm, adapters):
    app = build_app(llm.engine, ServerSettings(model_name="tiny", lora_modules=[("all", adapters["all"])]))
    c = TestClient(app)  # no lifespan: the routes alone
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["qv"]})
    assert r.status_code == 404 and "error" in r.json()


def test_bad_startup_adapter_stops_the_start(llm, allowed):
    root, _ = allowed
    with pytest.raises(ValueError, match="over max_lora_rank 8"):
        build_app(llm.engine, ServerSettings(model_name="tiny", lora_modules=[("big", str(root / "big"))]))
    with pytest.raises(ValueError, match="needs at least one --lora-allowed-dir"):
        build_app(llm.engine, ServerSettings(model_name="tiny", enable_lora_runtime_updates=True))


def test_hostile_adapter_bodies_are_4xx(client, allowed):
    """A corpus of malformed load / unload bodies and model names: each a 4xx in OpenAI's shape,
    the server still serving the base model and the adapters afterwards."""
    root, outside = allowed
    good = str(root / "good")
    corpus = [
        ("/v1/load_lora_adapter", b"[]"), ("/v1/load_lora_adapter", b"null"), ("/v1/load_lora_adapter", b"{}"),
        ("/v1/load_lora_adapter", b'{"lora_name": 1, "lora_path": 2}'),
        ("/v1/load_lora_adapter", b'{"lora_name": ["a"], "lora_path": "' + good.encode() + b'"}'),
        ("/v1/load_lora_adapter", b'{"lora_name": "tiny", "lora_path": "' + good.encode() + b'"}'),
        ("/v1/load_lora_adapter", b'{"lora_name": "n", "lora_path": "' + good.encode() + b'\\u0000"}'),
        ("/v1/load_lora_adapter", b'{"lora_name": "n", "lora_path": "\\ud800"}'),
        ("/v1/load_lora_adapter", b'{"lora_name": "n", "lora_path": "/"}'),
        ("/v1/load_lora_adapter", b'{"lora_name": "n", "lora_path": "relative/dir"}'),
        ("/v1/load_lora_adapter", b'{"lora_name": "n", "lora_path": "' + str(root).encode() + b'"}'),
        ("/v1/load_lora_adapter", b'{"lora_name": "n", "lora_path": "' + good.encode() +
         b'/adapter_config.json"}'),
        ("/v1/load_lora_adapter", b'{"lora_name": "' + b"n" * 100000 + b'", "lora_path": "/x"}'),
        ("/v1/unload_lora_adapter", b'{"lora_name": "tiny"}'), ("/v1/unload_lora_adapter", b'{"lora_name": 5}'),
        ("/v1/unload_lora_adapter", b"{}"),
        ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}'),
        ("/v1/completions", b'{"model": "all ", "prompt": "x"}'), ("/v1/completions", b'{"model": 7, "prompt": "x"}'),
    ]
    for path, body in corpus:
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (path, body[:80], r.status_code, r.text[:200])
        assert set(r.json()["error"]) >= {"message", "type", "code", "param"}
    assert {m["id"] for m in client.get("/v1/models").json()["data"]} == {"tiny", "all", "qv"}
    assert _complete(client, "all").status_code == 200
