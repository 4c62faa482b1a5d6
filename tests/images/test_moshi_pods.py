"""The Moshi worker image, run as the chart renders it for `plugin: moshi`: the tiny random
checkpoint on the model volume (a hostPath here, mounted read-only at workers.modelDir), an
API pod and Redis. A client of Moshi's protocol (`/api/chat`, as LiveKit's PersonaPlex plugin
speaks it) talks to the model through them."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from harness.protocol_clients import MoshiClient
from tests.e2e.waits import until
from tests.images.conftest import Release, release_values

MODEL_DIR = "/models/tiny-moshi"
#: greedy decoding on the CPU, one thread (as tests/plugins/moshi)
OPTIONS = {"device": "cpu", "temperature": "0", "temperature_text": "0", "threads": "1"}


#: the module's pods start once, for its tests: their set-up (images' start, a model's
#: load, probes) counts against the first test's time
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def moshi(start_release, tiny_moshi: Path) -> Release:
    values = release_values(
        replicas=1,
        plugin="moshi",
        maxSessions=2,
        modelDir=MODEL_DIR,
        modelVolume={"hostPath": str(tiny_moshi), "subPath": "checkpoint"},
        pluginOptions=OPTIONS,
    )
    return start_release("moshi", values)


async def test_a_moshi_protocol_session_on_the_mounted_checkpoint(moshi: Release):
    (worker,) = moshi.workers
    # the checkpoint is mounted read-only where the chart says
    refused = worker.exec("python", "-c", f"open('{MODEL_DIR}/written', 'w')")
    assert "Read-only file system" in refused.stderr, refused.stderr
    with urllib.request.urlopen(f"{moshi.api_base}/v1/models", timeout=10) as response:
        (model,) = [entry["id"] for entry in json.loads(response.read())["data"]]

    client = MoshiClient(moshi.api_base, model)
    await client.open()
    try:
        assert client.events == ["handshake"]
        rng = np.random.default_rng(7)
        speaking = asyncio.create_task(
            client.speak((0.2 * rng.standard_normal(24_000 * 3)).astype(np.float32))
        )

        async def audio_messages() -> int:
            return client.events.count("audio")

        await until(audio_messages, lambda count: count >= 5, 60)
        await speaking
        assert client.close_code is None  # the session is still open
    finally:
        await client.close()
    assert "Traceback" not in worker.logs()
    assert "Traceback" not in moshi.api.logs()
    # the API image has libopus (Debian's libopus0), so the pod encodes with it and never
    # falls back to sphn's costlier writer
    assert "sphn's Opus encoder" not in moshi.api.logs()
    found = moshi.api.exec(
        "python", "-c", "from services.api import libopus; print(libopus.version())"
    )
    assert found.stdout.startswith("libopus "), found.stdout + found.stderr
