"""OpenBMB's realtime SDK (`openbmb-realtime` 0.1.6, unchanged) against `duplex serve --plugin
minicpmo` on the tiny MiniCPM-o checkpoint (clients/minicpmo_map_client.py), as its own code
expects its model to behave:

- mode=audio: `connect()` through session.init and session.created; float32 16 kHz sent with
  `send_audio`, the model's voice back as float32 24 kHz `AudioDelta`s (a second a unit), its
  words as `TextDelta`s (kind `text`), the turn it ends as `TurnCompleted`; `close()` ends
  with `SessionClosed`, no error on the way;
- mode=video: a JPEG with every chunk (`send_audio_video`); the model answers and saw the
  JPEG (its unit records in Redis hold it, byte for byte);
- `interrupt()` while the model speaks: the next append says force_listen, the model's
  response ends cancelled, and the model is heard again after it.

The server runs from .venv-minicpmo (`make test-map-client` passes its python as
MAP_MINICPMO_PYTHON), on a redis-server, so that the test reads the model's records; the
tests skip without it. See conftest.py for how the client runs.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from harness.client_programs import run_client_program
from harness.minicpmo_serve import (
    MODEL,
    HistoryWatcher,
    build_checkpoint,
    minicpmo_python,
    start_minicpmo_serve,
)
from harness.minicpmo_sounds import camera_frame, turns
from plugins.minicpmo.records import TokenOrigin
from tests.map_client.conftest import CLIENTS, ClientRun, map_python

KEY = "k-map-minicpmo"
CLIENT_TIMEOUT_S = 240
STEP_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def minicpmo(tmp_path_factory) -> dict[str, Path]:
    """.venv-minicpmo's python, the tiny checkpoint, the voice (raw float32) and a JPEG."""
    python = minicpmo_python("MAP_MINICPMO_PYTHON")
    if python is None:
        pytest.skip("no .venv-minicpmo: run `make test-map-client`, which builds it")
    root = tmp_path_factory.mktemp("map-minicpmo")
    voice = root / "voice.f32"
    voice.write_bytes(turns(1).astype("<f4").tobytes())  # 2 s of voice, 2 s of quiet
    frame = root / "frame.jpg"
    frame.write_bytes(camera_frame(7))
    return {
        "python": python,
        "checkpoint": build_checkpoint(python, root / "tiny"),
        "voice": voice,
        "frame": frame,
    }


@pytest.fixture(scope="module")
def minicpmo_serve(minicpmo, redis_server):
    prefix = f"map-minicpmo-{uuid.uuid4().hex[:6]}"
    process = start_minicpmo_serve(
        minicpmo["python"],
        minicpmo["checkpoint"],
        "serve-map-minicpmo",
        ("--max-sessions", "2"),
        DUPLEX_API_KEYS=KEY,
        DUPLEX_REDIS_URL=redis_server.url,
        DUPLEX_KEY_PREFIX=prefix,
    )
    try:
        process.wait_ready(timeout=180)
        yield process, prefix
    finally:
        process.stop()


@pytest.fixture(scope="module")
def minicpmo_runs() -> dict[str, ClientRun]:
    """Runs already made, by scenario: tests that judge one run share it."""
    return {}


@pytest.fixture
def run_client(minicpmo_serve, minicpmo_runs, minicpmo, redis_server):
    """`run_client(scenario)`: that scenario's run (made once), with `records`: the model
    histories Redis held while it ran, as unit records by key."""

    def run(scenario: str) -> ClientRun:
        if scenario in minicpmo_runs:
            return minicpmo_runs[scenario]
        serve, prefix = minicpmo_serve
        command = [
            map_python(),
            str(CLIENTS / "minicpmo_map_client.py"),
            "--url",
            serve.base,
            "--key",
            KEY,
            "--model",
            MODEL,
            "--scenario",
            scenario,
            "--audio",
            str(minicpmo["voice"]),
            "--jpeg",
            str(minicpmo["frame"]),
            "--step-timeout",
            str(STEP_TIMEOUT_S),
        ]
        with HistoryWatcher(redis_server.url, prefix) as watcher:
            result = run_client_program(
                command,
                server=serve,
                marker='{"map_client"',
                label=scenario,
                timeout_s=CLIENT_TIMEOUT_S,
                cwd=CLIENTS,
                env={"NO_PROXY": "*"},
                run_class=ClientRun,
            )
        result.records = watcher.records()  # type: ignore[attr-defined]
        minicpmo_runs[scenario] = result
        return result

    return run


def test_audio_both_ways_words_by_kind_and_close(run_client):
    run = run_client("audio")
    assert run.failed_step is None, run.explain()
    assert run["sdk_version"] == "0.1.6"
    assert run["subprotocol"] == "map.realtime", run.explain()
    assert run["init"] == {"type": "session.init", "payload": {"system_prompt": "Be brief."}}
    assert run["state_after_connect"] == "ready"
    assert run["received"][:2] == ["session.queue_done", "session.created"], run.explain()
    heard = run["heard"]
    # float32 at 24 kHz: at most a second (24,000 samples, 96,000 bytes) a unit, not silent
    assert 0 < heard["max_delta_bytes"] <= 24_000 * 4, run.explain()
    assert heard["samples"] >= 24_000 and heard["finite"] and heard["peak"] > 0.01, run.explain()
    assert "there" in "".join(run["texts"]), run.explain()
    assert "text" in run["kinds"], run.explain()
    assert "completed" in run["done"], run.explain()
    events = run["events"]
    assert events[:2] == ["WorkerAssigned", "SessionReady"], run.explain()
    assert "TurnCompleted" in events and events[-1] == "SessionClosed", run.explain()
    assert run["errors"] == [] and run["warnings"] == [], run.explain()
    assert run["state_after_close"] == "closed"
    (records,) = run.records.values()
    assert len(records) >= 3 and not any(r.images for r in records), run.explain()


def test_a_video_session_shows_the_model_its_jpeg(run_client, minicpmo):
    run = run_client("video")
    assert run.failed_step is None, run.explain()
    assert run["frames_per_append"] == [1], run.explain()
    assert "there" in "".join(run["texts"]), run.explain()
    assert run["heard"]["peak"] > 0.01, run.explain()
    assert run["errors"] == [] and run["warnings"] == [], run.explain()
    (records,) = run.records.values()
    seen = [image for r in records for image in r.images]
    # the newest of a unit's frames is the one it takes: one JPEG a unit, the client's
    assert len(seen) >= 3 and set(seen) == {minicpmo["frame"].read_bytes()}, run.explain()
    assert all(len(r.images) == 1 for r in records[1:]), run.explain()


def test_interrupt_forces_listen_and_cuts_the_models_speech(run_client):
    run = run_client("interrupt")
    assert run.failed_step is None, run.explain()
    assert run["interrupted"] and run["force_listen_appends"] == 1, run.explain()
    assert "cancelled" in run["statuses"], run.explain()
    assert run["errors"] == [] and run["state"] != "failed", run.explain()
    (records,) = run.records.values()
    # the barge-in reached the model: a unit began with two forced tokens (only a barge-in
    # forces the first: `<|turn_eos|>`, then `<|listen|>`)
    forced = (TokenOrigin.FORCED, TokenOrigin.FORCED)
    assert any(r.origins[:2] == forced for r in records), run.explain()
