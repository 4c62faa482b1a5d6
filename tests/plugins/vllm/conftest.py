"""One vLLM engine for the module, on the tiny random Llama of harness/tiny_llama.py.

Runs only where vLLM is installed (`make test-vllm` builds `.venv-vllm` with the CPU build);
tests/plugins/conftest.py leaves this folder out elsewhere.
"""

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
import pytest_asyncio

from harness.tiny_llama import TINY_ENGINE, make_tiny_llama
from services.worker.stages.vllm import EngineSettings, build_engine


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(path)
    return str(path)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine(tiny_llama):
    engine = build_engine(EngineSettings(tiny_llama, **TINY_ENGINE))
    yield engine
    engine.shutdown()
    del engine
    gc.collect()  # AsyncLLM.__del__ now, not at interpreter exit with its modules half gone
