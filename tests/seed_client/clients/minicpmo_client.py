"""vLLM-Omni's reference client, `vllm_omni.clients.duplex.DuplexClient` 0.30.0 (unchanged,
never copied here), with its MiniCPM-o 4.5 preset (`vllm_omni.clients.minicpmo_4_5`), against
`duplex serve --plugin minicpmo` on the tiny checkpoint: the seed's validation of its duplex
model, one scenario a run, its facts printed as one JSON line for tests/seed_client to judge.

    PYTHONPATH=.venv-seed/client .venv-seed/bin/python \
        tests/seed_client/clients/minicpmo_client.py --url ws://127.0.0.1:8000 \
        --model minicpmo --scenario demo --speech voice.wav

The seed validates MiniCPM-o with two programs (vLLM-Omni's
examples/online_serving/minicpmo/realtime_duplex_demo.py and
tests/e2e/online_serving/run_minicpmo_realtime_duplex_multi_session.py); these scenarios are
what they check, driven through DuplexClient's own API: one turn (the preset's session,
the WAV streamed at real time in 200 ms appends, `commit()`, the model's decision and its
audio, played and acknowledged, `close()`: session.closed), the same with a camera frame a
unit (`stream_pcm(video_frames=...)`), sessions side by side, admission, resume, takeover
and expiry. The preset's session is model-driven (auto_response), so the model, not a
commit, decides when to speak: every wait is for the model's events, bounded by
--step-timeout. The camera frame (a JPEG) is the file SEED_CAMERA_FRAME names.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
from pathlib import Path
from typing import Any

from _common import Report, next_response, play, run, speech, summary, within
from seed_client import consume, seqs
from vllm_omni.clients.duplex import (
    DuplexClient,
    DuplexProtocolError,
    DuplexSessionClosedError,
    ReconnectPolicy,
    build_realtime_url,
)
from vllm_omni.clients.minicpmo_4_5 import create_duplex_session_config

#: the seed's MiniCPM-o session: listen_only overlap, ack_only playback, force_listen_count 0
PRESET = create_duplex_session_config()
#: the demo's appends (its --chunk-ms default)
CHUNK_MS = 200


def camera_frames() -> list[str]:
    """The camera's frame, base64, as stream_pcm takes them (a still image repeats)."""
    return [base64.b64encode(Path(os.environ["SEED_CAMERA_FRAME"]).read_bytes()).decode()]


def attachment(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k in ("session_id", "attachment_generation")}


def session_facts(session: dict[str, Any]) -> dict[str, Any]:
    capabilities = session.get("capabilities") or {}
    return {
        "model": session.get("model"),
        "overlap_policy": session.get("overlap_policy"),
        "playback_commit_policy": session.get("playback_commit_policy"),
        "extra_body": session.get("extra_body"),
        "chunk_period_ms": capabilities.get("chunk_period_ms"),
        "implementation_level": capabilities.get("implementation_level"),
        "session_admission_mode": capabilities.get("session_admission_mode"),
        "supports_image_input": capabilities.get("supports_image_input"),
    }


async def one_turn(
    client: DuplexClient, args: argparse.Namespace, video: list[str] | None = None
) -> dict[str, Any]:
    """The demo's turn: the WAV streamed in real time, committed, the model's answer
    played (acked as it plays) to its end, the whole answer acknowledged."""
    frames_sent = await client.stream_pcm(
        speech(args), chunk_ms=CHUNK_MS, realtime=True, video_frames=video
    )
    await client.commit()
    response = await next_response(client, "the model's answer", args.step_timeout)
    await play(client, response, "its audio, acked as played", args.step_timeout, ack=True)
    await within("its response.done", response.wait(), args.step_timeout)
    await client.ack_playback(response.played_ms, response_id=response.response_id)
    return {"response": summary(response), "frames_sent": frames_sent}


async def demo(args: argparse.Namespace, report: Report, video: bool = False) -> None:
    """realtime_duplex_demo.py's one turn, then close()."""
    client, recorder = report.client("a", PRESET)
    async with client:
        await recorder.wait_type("session.updated", args.step_timeout)
        report.fact(
            sent=recorder.sent(0)[0],
            session=session_facts(recorder.first("session.updated")["session"]),
            **await one_turn(client, args, camera_frames() if video else None),
        )
        await recorder.wait_type("input_audio_buffer.committed", args.step_timeout)
        await client.close(timeout_s=args.step_timeout)
    report.fact(
        committed=len(recorder.of_type("input_audio_buffer.committed")),
        acknowledged=len(recorder.of_type("playback.acknowledged")),
        closed=recorder.first("session.closed"),
        audio_rates=sorted(
            {e.get("sample_rate_hz") for e in recorder.of_type("response.output_audio.delta")}
        ),
        words=[e.get("delta") for e in recorder.of_type("response.output_audio_transcript.delta")],
    )


async def demo_video(args: argparse.Namespace, report: Report) -> None:
    """The demo with a camera: a frame rides the append that closes each 1 s unit."""
    await demo(args, report, video=True)


async def bad_frame(args: argparse.Namespace, report: Report) -> None:
    """A frame that is not an image: the client's responses() raises the server's
    refusal; the session goes on, and the next turn (with a good frame) is answered. The
    frame rides the append that closes the first unit, so 1.2 s of the clip's quiet end
    carry it (quiet: the model listens, no response comes before the refusal)."""
    client, _ = report.client("a", PRESET)
    async with client:
        await client.stream_pcm(
            speech(args)[-32 * 1200 :],
            chunk_ms=CHUNK_MS,
            video_frames=[base64.b64encode(b"GIF89a" + bytes(32)).decode()],
        )
        try:
            await next_response(client, "the refusal", args.step_timeout)
            report.fact(refused=None)
        except DuplexProtocolError as refused:
            report.fact(refused={"code": refused.code, "param": refused.raw["error"].get("param")})
        report.fact(**await one_turn(client, args, camera_frames()))
        await client.close(timeout_s=args.step_timeout)


async def sessions(args: argparse.Namespace, report: Report) -> None:
    """Two sessions at once, each its own turn (the multi-session driver's concurrent
    demos): each is answered, and no response is the other's."""
    clients = [report.client(name, PRESET) for name in ("a", "b")]

    async def session(client: DuplexClient) -> dict[str, Any]:
        async with client:
            facts = await one_turn(client, args)
            await client.close(timeout_s=args.step_timeout)
        return {"session_id": client.session_id, **facts}

    results = await asyncio.gather(*(session(client) for client, _ in clients))
    report.fact(
        sessions=results,
        response_ids=[
            sorted({e["response_id"] for e in r.of_type("response.created")}) for _, r in clients
        ],
    )


async def admission(args: argparse.Namespace, report: Report) -> None:
    """A server of 2 sessions: a third open is refused; one opened right after a client
    saw session.closed is accepted at once."""
    a, a_frames = report.client("a", PRESET)
    b, _ = report.client("b", PRESET)
    c, _ = report.client("c", PRESET)
    d, d_frames = report.client("d", PRESET)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(a)
        await stack.enter_async_context(b)
        try:
            async with c:
                report.fact(third={"opened": c.session_id})
        except DuplexProtocolError as refused:
            report.fact(third={"code": refused.code})
        await a.close(timeout_s=args.step_timeout)
        report.fact(a_closed=a_frames.first("session.closed"))
        try:
            async with d:
                report.fact(replacement={"opened": d.session_id})
                report.fact(**await one_turn(d, args))
        except DuplexProtocolError as refused:
            report.fact(replacement={"code": refused.code})
        created = d_frames.first("session.created")
        report.fact(session=session_facts((created or {}).get("session") or {}))


async def resume(args: argparse.Namespace, report: Report) -> None:
    """The socket drops while the model speaks (aborted, no close frame): the client
    resumes on its own, the answer goes on, and every event reaches it once, in order."""
    client, recorder = report.client(
        "a", PRESET, reconnect=ReconnectPolicy(max_attempts=5, backoff_s=(0.05, 0.25))
    )
    async with client:
        collector, _ = await consume(client)
        talking = asyncio.create_task(
            client.stream_pcm(speech(args) * 2, chunk_ms=CHUNK_MS, realtime=True)
        )
        response = await next_response(client, "the model's answer", args.step_timeout)
        await play(client, response, "a second of it", args.step_timeout, until_ms=900)
        dropped_after = max(seqs(recorder.received(0)))
        generation = recorder.first("session.created", 0).get("attachment_generation")
        recorder.connections[0].abort()
        resumed = await recorder.wait_type("session.resumed", args.step_timeout, connection=1)
        await play(client, response, "the rest of it", args.step_timeout)
        await within("its response.done", response.wait(), args.step_timeout)
        await within("the microphone", talking, args.step_timeout)
        await client.close(timeout_s=args.step_timeout)
        report.fact(
            response=summary(response),
            connections=len(recorder.connections),
            dropped_after_seq=dropped_after,
            generation=generation,
            resumed={
                k: v for k, v in resumed.items() if k in ("session_id", "attachment_generation")
            },
            token_rotated=resumed.get("resume_token")
            not in (None, recorder.first("session.created", 0).get("resume_token")),
            seqs_on_second=seqs(recorder.received(1))[:5],
            delivered_seqs=seqs(collector.events),
        )


async def takeover(args: argparse.Namespace, report: Report) -> None:
    """While the model speaks, a second connection resumes the session with its token: the
    first is told session.replaced and closed; the second talks on with the same session
    (the model answers it) and closes it."""
    client, recorder = report.client(
        "a", PRESET, reconnect=ReconnectPolicy(max_attempts=2, backoff_s=(0.05, 0.1))
    )
    async with client:
        _, collecting = await consume(client)
        talking = asyncio.create_task(
            client.stream_pcm(speech(args), chunk_ms=CHUNK_MS, realtime=True)
        )
        first = await next_response(client, "the model's answer to a", args.step_timeout)
        token = client.resume_token
        generation = recorder.first("session.created").get("attachment_generation")
        other = report.recorder("b")
        url = build_realtime_url(f"{args.url}/v1/realtime", args.model, autostart=False)
        socket = await within("b connects", other.connect(url), args.step_timeout)

        async def read() -> None:
            with contextlib.suppress(Exception):
                while True:
                    await socket.recv()

        reading = asyncio.create_task(read())
        await socket.send(
            json.dumps(
                {
                    "type": "session.resume",
                    "session_id": client.session_id,
                    "resume_token": token,
                    "last_received_server_event_seq": max(seqs(recorder.received())),
                }
            )
        )
        resumed = await other.wait_type("session.resumed", args.step_timeout)
        replaced = await recorder.wait_type("session.replaced", args.step_timeout)
        talking.cancel()
        await within("a gives up", collecting, args.step_timeout)
        try:
            await client.send({"type": "session.heartbeat"})
            a_ended = None
        except DuplexSessionClosedError as closed:
            a_ended = closed.reason
        # b talks on in the same session: the model answers it
        at = len(other.received())
        pcm = speech(args)
        for offset in range(0, len(pcm), 32 * CHUNK_MS):
            chunk = base64.b64encode(pcm[offset : offset + 32 * CHUNK_MS]).decode()
            await socket.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            await asyncio.sleep(CHUNK_MS / 1000)  # a microphone's pace
        await other.until(
            "b hears the model",
            lambda: any(
                e.get("type") == "response.output_audio.delta" for e in other.received()[at:]
            ),
            args.step_timeout,
        )
        await socket.send(json.dumps({"type": "session.close"}))
        closed = await other.wait_type("session.closed", args.step_timeout)
        reading.cancel()
        await socket.close()
        report.fact(
            session_id=client.session_id,
            a_answered=first.decision,
            generation=generation,
            resumed={
                k: v for k, v in resumed.items() if k in ("session_id", "attachment_generation")
            },
            token_rotated=resumed.get("resume_token") not in (None, token),
            replaced={k: v for k, v in replaced.items() if k != "event_id"},
            a_ended=a_ended,
            a_resume_replies=[
                (e.get("error") or {}).get("code") or e.get("type") for e in recorder.received(1)
            ],
            b_closed=closed.get("session_id"),
        )


async def expiry(args: argparse.Namespace, report: Report) -> None:
    """The network goes away past the disconnect grace (a server of one session and a
    grace of 1 s) while the model has the session: once its slot is free again the network
    is back, and the client's resume is refused as expired."""
    client, recorder = report.client(
        "a",
        PRESET,
        reconnect=ReconnectPolicy(max_attempts=300, backoff_s=(0.1, 0.2)),
        heartbeat_interval_s=None,
    )
    async with client:
        _, collecting = await consume(client)
        await client.stream_pcm(speech(args), chunk_ms=CHUNK_MS, realtime=True)
        await next_response(client, "the model's answer", args.step_timeout)
        recorder.offline = True
        recorder.connections[0].abort()

        async def slot_free() -> int:
            """Opens until one is admitted (the expired session's slot)."""
            attempts = 0
            while True:
                attempts += 1
                probe = DuplexClient(
                    args.url,
                    model=args.model,
                    config=PRESET,
                    reconnect=None,
                    heartbeat_interval_s=None,
                )
                try:
                    async with probe:
                        return attempts
                except DuplexProtocolError as refused:
                    if refused.code != "resource_exhausted":
                        raise
                await asyncio.sleep(0.2)  # a poll's pace, not an order of events

        attempts = await within("the session's slot comes free", slot_free(), 60)
        recorder.offline = False
        await within("the client's resume ends", collecting, args.step_timeout)
        try:
            await client.send({"type": "session.heartbeat"})
            ended = None
        except DuplexSessionClosedError as closed:
            ended = closed.reason
        report.fact(
            probe_opens=attempts,
            resume_sent=[e.get("type") for e in recorder.sent(1)],
            resume_replies=[
                {"type": e.get("type"), "code": (e.get("error") or {}).get("code")}
                for e in recorder.received(1)
            ],
            ended=ended,
        )


SCENARIOS = {
    "demo": demo,
    "demo_video": demo_video,
    "bad_frame": bad_frame,
    "sessions": sessions,
    "admission": admission,
    "resume": resume,
    "takeover": takeover,
    "expiry": expiry,
}

if __name__ == "__main__":
    run(SCENARIOS)
