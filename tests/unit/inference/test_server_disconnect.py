"""A streaming client that goes away mid-stream: the server aborts its request, which leaves
the batch and frees its cache blocks. The server runs in this process (uvicorn on 127.0.0.1,
a thread) over an engine whose steps are slowed to 20 ms, so the request is certainly still
running when the client leaves, on any machine."""
import threading
import time

import pytest
import torch

import megatron_smp as smp
from megatron_smp.inference import InferenceEngine
from tests.unit.inference.common import hf_model_dir

requests = pytest.importorskip("requests")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture
def slow_server(tmp_path):
    from megatron_smp.inference.server import CompletionServer
    from megatron_smp.inference.text import TextCodec

    smp.init({"random_seed": 3})
    hf, tokenizer = hf_model_dir(tmp_path / "hf")
    engine = InferenceEngine(smp.transform(hf).module, max_tokens=512, block_size=16)
    step = engine.step
    engine.steps_taken = 0

    def slow_step(**kwargs):
        time.sleep(0.02)
        engine.steps_taken += 1
        return step(**kwargs)

    engine.step = slow_step
    app = CompletionServer(engine, TextCodec(tokenizer), "tiny").app
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not (http.started and http.servers) and time.time() < deadline:
        time.sleep(0.05)
    assert http.started, "the server did not start in 30 s"
    port = http.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        http.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop in 30 s"


def test_disconnected_stream_frees_its_slot(slow_server):
    url, engine = slow_server
    free = {kind: a.num_free for kind, a in engine.allocators.items()}
    with requests.post(f"{url}/v1/completions", stream=True, timeout=30, json={
            "prompt": "In the beginning", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}) as response:
        assert next(response.iter_lines())  # the first chunk came
        health = requests.get(f"{url}/health", timeout=30).json()
        assert health["running"] == 1 and health["aborted"] == 0
    deadline = time.time() + 30
    while requests.get(f"{url}/health", timeout=30).json()["running"] and time.time() < deadline:
        time.sleep(0.05)
    health = requests.get(f"{url}/health", timeout=30).json()
    assert health["running"] == 0 and health["aborted"] == 1
    # it left well before its 100 tokens, and its blocks are free again
    assert engine.steps_taken < 60 and not engine.requests
    assert {kind: a.num_free for kind, a in engine.allocators.items()} == free
