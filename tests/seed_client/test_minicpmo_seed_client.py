"""vLLM-Omni's DuplexClient 0.30.0 (unchanged) with its MiniCPM-o 4.5 preset against
`duplex serve --plugin minicpmo` on the tiny checkpoint: the seed's own validation of its
duplex model (clients/minicpmo_client.py), as the client sees it:

- the one-turn demo: the preset's session as applied (listen_only, ack_only,
  force_listen_count), the WAV streamed in real time, committed, the model's spoken answer
  (24 kHz audio, its words) played and acknowledged, session.closed on close();
- the demo with a camera frame a unit (`stream_pcm(video_frames=...)`): the model saw it (its
  unit records in Redis hold the JPEG, byte for byte); a frame that is not an image is
  refused through the client's `responses()`, and the session goes on;
- two sessions at once, each answered, no response shared;
- admission at 2 sessions, resume after a dropped socket while the model speaks (no event
  lost), takeover by a second connection (which the model goes on answering), expiry.

The server runs from .venv-minicpmo (`make test-seed-client` passes its python as
SEED_MINICPMO_PYTHON); the tests skip without it. See conftest.py for how the client runs.
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
from harness.minicpmo_sounds import camera_frame, turns, write_wav
from harness.processes import HttpProcess
from tests.seed_client.conftest import CLIENTS, ClientRun, seed_client

#: one client run, its steps and the server (a 1 s unit takes up to a second of CPU here)
CLIENT_TIMEOUT_S = 240
STEP_TIMEOUT_S = 60
#: servers by name: `duplex serve` arguments and environment (as conftest.py's SERVERS)
SERVERS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "default": (("--max-sessions", "4"), {}),
    "admission": (("--max-sessions", "2"), {}),
    "expiry": (("--max-sessions", "1"), {"DUPLEX_DISCONNECT_GRACE_S": "1"}),
}


@pytest.fixture(scope="module")
def minicpmo(tmp_path_factory) -> dict[str, Path]:
    """.venv-minicpmo's python, the tiny checkpoint, the voice and the camera frame."""
    python = minicpmo_python("SEED_MINICPMO_PYTHON")
    if python is None:
        pytest.skip("no .venv-minicpmo: run `make test-seed-client`, which builds it")
    root = tmp_path_factory.mktemp("seed-minicpmo")
    frame = root / "frame.jpg"
    frame.write_bytes(camera_frame(5))
    return {
        "python": python,
        "checkpoint": build_checkpoint(python, root / "tiny"),
        "speech": write_wav(root / "voice.wav", turns(1)),  # 2 s of voice, 2 s of quiet
        "frame": frame,
    }


class Servers:
    """The MiniCPM-o servers by name (SERVERS), started when first asked for; the default
    one on redis-server under its own key prefix, so that a test reads the model's records."""

    def __init__(self, minicpmo: dict[str, Path], redis_url: str) -> None:
        self.minicpmo = minicpmo
        self.redis_url = redis_url
        self.prefix = f"seed-minicpmo-{uuid.uuid4().hex[:6]}"
        self.running: dict[str, HttpProcess] = {}

    def get(self, name: str) -> HttpProcess:
        if name not in self.running:
            args, env = SERVERS[name]
            if name == "default":
                env = {**env, "DUPLEX_REDIS_URL": self.redis_url, "DUPLEX_KEY_PREFIX": self.prefix}
            self.running[name] = start_minicpmo_serve(
                self.minicpmo["python"],
                self.minicpmo["checkpoint"],
                f"serve-seed-minicpmo-{name}",
                args,
                **env,
            )
            self.running[name].wait_ready(timeout=180)
        return self.running[name]

    def stop(self) -> None:
        for process in self.running.values():
            process.stop()


@pytest.fixture(scope="module")
def minicpmo_servers(minicpmo, redis_server):
    servers = Servers(minicpmo, redis_server.url)
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def minicpmo_runs() -> dict[tuple[str, str], ClientRun]:
    """Runs already made, by (server, scenario): tests that judge one run share it."""
    return {}


@pytest.fixture
def run_client(minicpmo_servers, minicpmo_runs, minicpmo, redis_server):
    """`run_client(scenario, server="default")`: that scenario's run (made once), with
    `records`: the model histories the default server's Redis held while it ran, as unit
    records by key (each at its longest: a closed session's history is deleted)."""

    def run(scenario: str, server: str = "default") -> ClientRun:
        if (server, scenario) in minicpmo_runs:
            return minicpmo_runs[(server, scenario)]
        python, client_path = seed_client()
        serve = minicpmo_servers.get(server)
        command = [
            python,
            str(CLIENTS / "minicpmo_client.py"),
            "--url",
            serve.base.replace("http://", "ws://"),
            "--model",
            MODEL,
            "--scenario",
            scenario,
            "--speech",
            str(minicpmo["speech"]),
            "--step-timeout",
            str(STEP_TIMEOUT_S),
        ]
        with HistoryWatcher(redis_server.url, minicpmo_servers.prefix) as watcher:
            result = run_client_program(
                command,
                server=serve,
                marker='{"seed_client"',
                label=scenario,
                timeout_s=CLIENT_TIMEOUT_S,
                cwd=CLIENTS,
                env={
                    "PYTHONPATH": client_path,
                    "NO_PROXY": "*",
                    "SEED_CAMERA_FRAME": str(minicpmo["frame"]),
                },
                run_class=ClientRun,
            )
        result.records = watcher.records()  # type: ignore[attr-defined]
        minicpmo_runs[(server, scenario)] = result
        return result

    return run


def spoke(response: dict) -> bool:
    return (
        response["decision"] == "speak"
        and response["status"] == "completed"
        and response["audio_ms"] >= 1000  # at least a unit of the model's voice
        and "there" in response["transcript"]
    )


def test_the_one_turn_demo(run_client):
    run = run_client("demo")
    assert run.failed_step is None, run.explain()
    extra_body = run["sent"]["session"]["extra_body"]
    assert extra_body == {"auto_response": True, "force_listen_count": 0}, run.explain()
    session = run["session"]
    assert session["model"] == MODEL
    assert session["overlap_policy"] == "listen_only"
    assert session["playback_commit_policy"] == "ack_only"
    assert session["implementation_level"] == "model_native_duplex"
    assert session["chunk_period_ms"] == 1000
    assert session["session_admission_mode"] == "engine_managed"
    assert spoke(run["response"]), run.explain()
    assert run["audio_rates"] == [24_000], run.explain()
    assert run["committed"] == 1 and run["acknowledged"] >= 1, run.explain()
    assert run["closed"]["type"] == "session.closed", run.explain()
    assert not run.error_codes(), run.explain()
    (records,) = run.records.values()
    assert len(records) >= 3 and not any(r.images for r in records), run.explain()


def test_the_demo_with_a_camera_frame_a_unit(run_client, minicpmo):
    run = run_client("demo_video")
    assert run.failed_step is None, run.explain()
    assert run["frames_sent"] >= 3, run.explain()  # one a unit of the 4 s clip
    assert spoke(run["response"]), run.explain()
    assert not run.error_codes(), run.explain()
    (records,) = run.records.values()
    seen = [image for r in records for image in r.images]
    assert len(seen) >= 3 and set(seen) == {minicpmo["frame"].read_bytes()}, run.explain()


def test_a_frame_that_is_not_an_image_is_refused_and_the_session_goes_on(run_client, minicpmo):
    run = run_client("bad_frame")
    assert run.failed_step is None, run.explain()
    assert run["refused"] == {"code": "invalid_video_frames", "param": "video_frames[0]"}
    assert spoke(run["response"]), run.explain()
    (records,) = run.records.values()
    assert {image for r in records for image in r.images} == {minicpmo["frame"].read_bytes()}


def test_two_sessions_at_once_are_each_answered(run_client):
    run = run_client("sessions")
    assert run.failed_step is None, run.explain()
    a, b = run["sessions"]
    assert a["session_id"] != b["session_id"]
    assert spoke(a["response"]) and spoke(b["response"]), run.explain()
    ids_a, ids_b = (set(ids) for ids in run["response_ids"])
    assert ids_a and ids_b and not ids_a & ids_b, run.explain()
    assert not run.error_codes(), run.explain()
    assert len(run.records) == 2, run.explain()


def test_admission_refuses_a_third_session_and_frees_a_slot_at_session_closed(run_client):
    run = run_client("admission", server="admission")
    assert run.failed_step is None, run.explain()
    assert run["third"] == {"code": "resource_exhausted"}, run.explain()
    assert run["a_closed"] is not None, run.explain()
    assert "opened" in run["replacement"], run.explain()
    assert spoke(run["response"]), run.explain()  # the freed slot's model answers
    assert run["session"]["session_admission_mode"] == "engine_managed"


def test_resume_while_the_model_speaks_loses_no_event(run_client):
    run = run_client("resume")
    assert run.failed_step is None, run.explain()
    assert run["connections"] == 2, run.explain()
    assert run["resumed"]["attachment_generation"] == run["generation"] + 1, run.explain()
    assert run["token_rotated"], run.explain()
    assert run["seqs_on_second"][0] <= run["dropped_after_seq"] + 1, run.explain()
    delivered = run["delivered_seqs"]
    assert delivered == list(range(delivered[0], delivered[0] + len(delivered))), run.explain()
    assert spoke(run["response"]), run.explain()
    assert not run.error_codes(), run.explain()


def test_takeover_replaces_the_first_connection_and_the_model_answers_the_second(run_client):
    run = run_client("takeover")
    assert run.failed_step is None, run.explain()
    assert run["a_answered"] == "speak", run.explain()
    assert run["resumed"] == {
        "session_id": run["session_id"],
        "attachment_generation": run["generation"] + 1,
    }, run.explain()
    assert run["token_rotated"], run.explain()
    replaced = run["replaced"]
    assert replaced["type"] == "session.replaced" and replaced["session_id"] == run["session_id"]
    assert replaced["attachment_generation"] == run["generation"], run.explain()
    assert run["a_ended"] is not None, run.explain()
    assert run["a_resume_replies"] in ([], ["session_resume_conflict"]), run.explain()
    assert run["b_closed"] == run["session_id"], run.explain()


def test_resume_after_expiry_is_refused(run_client):
    run = run_client("expiry", server="expiry")
    assert run.failed_step is None, run.explain()
    assert run["resume_sent"][:1] == ["session.resume"], run.explain()
    replies = run["resume_replies"]
    assert any(
        r["code"] == "session_resume_expired" or r["type"] == "session.expired" for r in replies
    ), run.explain()
    assert not any(r["type"] == "session.resumed" for r in replies), run.explain()
    assert run["ended"] is not None, run.explain()
    assert set(run.error_codes()) <= {"session_resume_expired"}, run.explain()
