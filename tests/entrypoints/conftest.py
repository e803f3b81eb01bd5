"""The server's test rig: the app under uvicorn on a thread of the test process, over an engine whose
core runs on another thread (the tests look inside it); `server` gives each test module its own."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from fastllm.engine.async_llm_engine import AsyncLLMEngine
from fastllm.engine.llm_engine import LLMEngine
from tests.engine.engine_testing import wait_idle

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
MODEL = "stories260K"


@contextlib.contextmanager
def serving(engine, **app_kwargs):
    """build_app(engine, ...) under uvicorn on a thread; yields its URL."""
    uvicorn = pytest.importorskip("uvicorn")
    from fastllm.entrypoints.openai.server import build_app

    app = build_app(engine, MODEL, **app_kwargs)
    with on_thread(uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                                 log_level="warning"))) as url:
        yield url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def on_thread(uv):
    """A uvicorn.Server (of 127.0.0.1) run on a thread until the block ends; yields its URL."""
    port = uv.config.port
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    for _ in range(400):
        if uv.started:
            break
        time.sleep(0.05)
    assert uv.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def thread_engine(**kwargs) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine.from_kwargs(None, device="cpu", dtype="float32", **kwargs))


@pytest.fixture(scope="module")
def server():
    engine = thread_engine(num_gpu_blocks=256)
    with serving(engine, chat_template=TEMPLATE) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture
def client(server):
    openai = pytest.importorskip("openai")
    url, engine = server
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    wait_idle(engine)
