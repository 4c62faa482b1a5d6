"""vLLM-Omni's reference client, `vllm_omni.clients.duplex.DuplexClient` as the vllm-omni
0.30.0 wheel ships it (unchanged, never copied here), against duplex serve: one scenario a
run, its facts printed as one JSON line for tests/seed_client to judge.

    PYTHONPATH=.venv-seed/client .venv-seed/bin/python tests/seed_client/clients/seed_client.py \
        --url ws://127.0.0.1:8000 --scenario open --speech harness/data/speech_16k.wav

Every wait is for an event (or for a condition on the events), bounded by --step-timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from _common import (
    Report,
    StepFailed,
    next_response,
    play,
    run,
    silence,
    speech,
    summary,
    within,
)
from vllm_omni.clients.duplex import (
    DuplexClient,
    DuplexProtocolError,
    DuplexSessionClosedError,
    EventCollector,
    ReconnectPolicy,
    SessionConfig,
    acknowledge_collected_playback,
    build_realtime_url,
    wait_for_condition,
)

#: turns without auto_response: the client asks for each response (commit or response.create)
EXPLICIT = SessionConfig(auto_response=False)
#: server VAD ends turns and speech over an answer barges in; a pause between two sayings of
#: the phrase (about 380 ms) does not end a turn
SERVER_VAD = SessionConfig(
    auto_response=False, turn_detection={"type": "server_vad", "silence_duration_ms": 800}
)
#: the answer's audio: pcm16 at the client's default output rate, 24 kHz
OUTPUT_BYTES_PER_MS = 48


def without_audio(event: dict[str, Any] | None) -> dict[str, Any] | None:
    """An event as a fact: its audio left out."""
    if event is None:
        return None
    return {k: ("<audio>" if k in ("delta", "audio") else v) for k, v in event.items()}


async def condition(label: str, predicate: Callable[[], Any], timeout: float) -> None:
    """upstream's wait_for_condition (a 20 ms poll of the collector), failing as a step."""
    try:
        await wait_for_condition(predicate, timeout_s=timeout, label=label)
    except TimeoutError:
        raise StepFailed(label, f"not seen within {timeout:.0f}s") from None


def seqs(events: list[dict[str, Any]]) -> list[int]:
    return [e["server_event_seq"] for e in events if isinstance(e.get("server_event_seq"), int)]


async def consume(client: DuplexClient) -> tuple[EventCollector, asyncio.Task[None]]:
    """The client's events from now on, in upstream's collector, and the task that fills it
    (it ends with the session)."""
    collector = EventCollector()
    task = asyncio.create_task(collector.consume(client))
    await asyncio.sleep(0)  # the collector subscribes before anything else runs
    return collector, task


# ---------------------------------------------------------------------------------- scenarios


async def open_session(args: argparse.Namespace, report: Report) -> None:
    """session.created, then session.updated (the session as applied)."""
    client, recorder = report.client("a", SessionConfig())
    async with client:
        await recorder.wait_type("session.updated", args.step_timeout)
        received = recorder.received(0)
        report.fact(
            session_id=client.session_id,
            resume_token=client.resume_token,
            sent=[e.get("type") for e in recorder.sent(0)],
            received=[e.get("type") for e in received[:3]],
            created=received[0],
            updated=recorder.first("session.updated"),
        )


async def auto_turn(args: argparse.Namespace, report: Report) -> None:
    """The client's docstring example on its default config (extra_body.auto_response: true):
    stream_pcm, commit(), and the first response of responses() speaks."""
    client, recorder = report.client("a", SessionConfig())
    async with client:
        update = recorder.sent(0)[0]
        report.fact(extra_body=update.get("session", {}).get("extra_body"))
        await client.stream_pcm(speech(args))  # real time, 200 ms appends
        await client.commit()
        report.fact(commit={k: v for k, v in recorder.sent(0)[-1].items() if k != "event_id"})
        response = await next_response(client, "a response to the commit", args.step_timeout)
        await play(client, response, "its audio, acked as played", args.step_timeout, ack=True)
        await within("its response.done", response.wait(), args.step_timeout)
        report.fact(response=summary(response), input_ms=len(speech(args)) / 32)


async def explicit_turns(args: argparse.Namespace, report: Report) -> None:
    """auto_response off: a turn answered on commit(create_response=True), then one committed
    with create_response=False and answered on response.create."""
    client, recorder = report.client("a", EXPLICIT)
    pcm = speech(args)
    async with client:
        await client.stream_pcm(pcm, realtime=False)
        await client.commit(create_response=True)
        first = await next_response(client, "the response of the first commit", args.step_timeout)
        await play(client, first, "its audio", args.step_timeout)
        await within("its response.done", first.wait(), args.step_timeout)

        await client.stream_pcm(pcm, realtime=False)
        await client.commit(create_response=False)
        await recorder.until(
            "the second commit's input_audio_buffer.committed",
            lambda: len(recorder.of_type("input_audio_buffer.committed")) >= 2,
            args.step_timeout,
        )
        await client.send({"type": "response.create"})
        second = await next_response(client, "the response of response.create", args.step_timeout)
        await play(client, second, "its audio", args.step_timeout)
        await within("its response.done", second.wait(), args.step_timeout)
        report.fact(
            input_ms=len(pcm) / 32,
            commits=[
                {k: v for k, v in e.items() if k != "event_id"}
                for e in recorder.sent(0)
                if e.get("type") == "input_audio_buffer.commit"
            ],
            responses=[summary(first), summary(second)],
            responses_created=len(recorder.of_type("response.created")),
            # per response, the order of the three events upstream's harness checks
            orders={
                response.response_id: [
                    e.get("type")
                    for e in recorder.received(0)
                    if e.get("response_id") == response.response_id
                    and e.get("type")
                    in (
                        "response.content_part.added",
                        "response.speak",
                        "response.output_audio.delta",
                    )
                ][:3]
                for response in (first, second)
            },
        )


async def playback_ack(args: argparse.Namespace, report: Report) -> None:
    """A response played to its end, then ack_playback of all of it."""
    client, recorder = report.client("a", EXPLICIT)
    async with client:
        await client.stream_pcm(speech(args), realtime=False)
        await client.commit(create_response=True)
        response = await next_response(client, "a response", args.step_timeout)
        await play(client, response, "its audio", args.step_timeout)
        await within("its response.done", response.wait(), args.step_timeout)
        await client.ack_playback(response.played_ms, response_id=response.response_id)
        ack = await recorder.wait_type("playback.acknowledged", args.step_timeout)
        report.fact(response=summary(response), ack=ack)


async def cancel(args: argparse.Namespace, report: Report) -> None:
    """cancel_response while the answer's audio streams; the next turn is answered."""
    client, recorder = report.client("a", EXPLICIT)
    pcm = speech(args)
    async with client:
        await client.stream_pcm(pcm * 3, realtime=False)
        await client.commit(create_response=True)
        response = await next_response(client, "a long response", args.step_timeout)
        await play(client, response, "500 ms of its audio", args.step_timeout, until_ms=500)
        await client.cancel_response(response.response_id)
        await play(client, response, "its audio to its end", args.step_timeout)
        await within("its response.done", response.wait(), args.step_timeout)
        events = recorder.received(0)
        done_at = next(
            i
            for i, e in enumerate(events)
            if e.get("type") == "response.done" and e.get("response_id") == response.response_id
        )
        late = [
            e.get("type")
            for e in events[done_at + 1 :]
            if e.get("response_id") == response.response_id
        ]

        await client.stream_pcm(pcm, realtime=False)
        await client.commit(create_response=True)
        following = await next_response(client, "the next turn's response", args.step_timeout)
        await play(client, following, "its audio", args.step_timeout)
        await within("its response.done", following.wait(), args.step_timeout)
        report.fact(
            input_ms=len(pcm) * 3 / 32,
            cancelled=summary(response),
            after_done=late,
            following=summary(following),
        )


async def barge_in(args: argparse.Namespace, report: Report) -> None:
    """Server VAD: the user talks over the answer (real time, as a microphone); the answer
    is cancelled and what the user said is answered."""
    client, recorder = report.client("a", SERVER_VAD)
    pcm = speech(args)
    async with client:
        await client.stream_pcm(pcm * 3 + silence(1200), realtime=False)
        first = await next_response(client, "the answer to the first turn", args.step_timeout)
        await play(client, first, "500 ms of the answer", args.step_timeout, until_ms=500)
        talking = asyncio.create_task(client.stream_pcm(pcm + silence(1200)))
        try:
            await play(client, first, "the answer until it ends", args.step_timeout)
            await within("its response.done", first.wait(), args.step_timeout)
            second = await next_response(client, "the answer to the barge-in", args.step_timeout)
            await play(client, second, "its audio", args.step_timeout)
            await within("its response.done", second.wait(), args.step_timeout)
        finally:
            await within("the microphone", talking, args.step_timeout)
        report.fact(
            first=summary(first),
            second=summary(second),
            first_input_ms=len(pcm) * 3 / 32,
            overlap=[
                {k: v for k, v in e.items() if k in ("action", "policy", "reason")}
                for e in recorder.of_type("overlap.decision")
            ],
            speech_started=len(recorder.of_type("input_audio_buffer.speech_started")),
        )


async def resume(args: argparse.Namespace, report: Report) -> None:
    """The socket drops mid-answer (aborted, no close frame): the client resumes on its own,
    and every event reaches it once, in order."""
    client, recorder = report.client(
        "a", EXPLICIT, reconnect=ReconnectPolicy(max_attempts=5, backoff_s=(0.05, 0.25))
    )
    pcm = speech(args) * 2
    async with client:
        collector, _ = await consume(client)
        await client.stream_pcm(pcm, realtime=False)
        await client.commit(create_response=True)
        response = await next_response(client, "a response", args.step_timeout)
        await play(client, response, "300 ms of its audio", args.step_timeout, until_ms=300)
        dropped_after = max(seqs(recorder.received(0)))
        recorder.connections[0].abort()
        await recorder.wait_type("session.resumed", args.step_timeout, connection=1)
        await play(client, response, "the rest of its audio", args.step_timeout)
        await within("its response.done", response.wait(), args.step_timeout)
        await condition(
            "rate_limits.updated after it",
            lambda: collector.count("rate_limits.updated") >= 1,
            args.step_timeout,
        )
        report.fact(
            input_ms=len(pcm) / 32,
            response=summary(response),
            connections=len(recorder.connections),
            dropped_after_seq=dropped_after,
            resume_sent=recorder.sent(1)[:1],
            resumed=recorder.first("session.resumed", 1),
            seqs_on_second=seqs(recorder.received(1)),
            # what the application got, in order (the client drops replayed duplicates)
            delivered=[
                e.get("type") for e in collector.events if not str(e.get("type")).endswith("delta")
            ],
            delivered_seqs=seqs(collector.events),
            last_seq=client._last_server_event_seq,
        )


async def takeover(args: argparse.Namespace, report: Report) -> None:
    """A second connection resumes the session with the token: the first gets session.replaced,
    and its own resume with the token it held (stale now) is refused."""
    client, recorder = report.client(
        "a", EXPLICIT, reconnect=ReconnectPolicy(max_attempts=2, backoff_s=(0.05, 0.1))
    )
    async with client:
        _, collecting = await consume(client)
        token = client.resume_token
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
                    "last_received_server_event_seq": max(seqs(recorder.received()), default=0),
                }
            )
        )
        resumed = await other.wait_type("session.resumed", args.step_timeout)
        replaced = await recorder.wait_type("session.replaced", args.step_timeout)
        await within("a gives up", collecting, args.step_timeout)
        try:
            await client.send({"type": "session.heartbeat"})
            ended = None
        except DuplexSessionClosedError as closed:
            ended = closed.reason
        await socket.send(json.dumps({"type": "session.close"}))
        closed = await other.wait_type("session.closed", args.step_timeout)
        reading.cancel()
        await socket.close()
        report.fact(
            session_id=client.session_id,
            token_rotated=resumed.get("resume_token") not in (None, token),
            resumed=resumed,
            replaced=replaced,
            a_connections=len(recorder.connections),
            a_resume_sent=[e.get("type") for e in recorder.sent(1)] if recorder.sent(1) else [],
            a_resume_replies=[
                {"type": e.get("type"), "code": (e.get("error") or {}).get("code")}
                for e in recorder.received(1)
            ],
            a_ended=ended,
            b_closed=closed,
        )


async def expiry(args: argparse.Namespace, report: Report) -> None:
    """The network goes away past the disconnect grace (a server with --max-sessions 1 and a
    grace of 1 s): once the session's slot is free again the network is back, and the client's
    resume is refused as expired."""
    client, recorder = report.client(
        "a",
        EXPLICIT,
        reconnect=ReconnectPolicy(max_attempts=300, backoff_s=(0.1, 0.2)),
        heartbeat_interval_s=None,
    )
    async with client:
        _, collecting = await consume(client)
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
                    config=EXPLICIT,
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

        attempts = await within("the session's slot comes free", slot_free(), 30)
        recorder.offline = False
        await within("the client's resume ends", collecting, args.step_timeout)
        try:
            await client.send({"type": "session.heartbeat"})
            ended = None
        except DuplexSessionClosedError as closed:
            ended = closed.reason
        report.fact(
            probe_opens=attempts,
            refused_connects=recorder.refused,
            connections=len(recorder.connections),
            resume_sent=[e.get("type") for e in recorder.sent(1)],
            resume_replies=[
                {
                    "type": e.get("type"),
                    "code": (e.get("error") or {}).get("code"),
                    "reason": e.get("reason"),
                }
                for e in recorder.received(1)
            ],
            ended=ended,
        )


async def close(args: argparse.Namespace, report: Report) -> None:
    """client.close(): session.closed with its reason, at the top and in `event`."""
    client, recorder = report.client("a", EXPLICIT)
    async with client:
        await client.close(timeout_s=args.step_timeout)
    try:
        await client.send({"type": "session.heartbeat"})
        ended = None
    except DuplexSessionClosedError as closed:
        ended = closed.reason
    report.fact(session_id=client.session_id, closed=recorder.first("session.closed"), ended=ended)


async def admission(args: argparse.Namespace, report: Report) -> None:
    """A server with --max-sessions 2: a third open is refused; one opened right after a
    client saw session.closed is accepted at once."""
    a, a_frames = report.client("a", EXPLICIT)
    b, _ = report.client("b", EXPLICIT)
    c, _ = report.client("c", EXPLICIT)
    d, _ = report.client("d", EXPLICIT)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(a)
        await stack.enter_async_context(b)
        try:
            async with c:
                report.fact(third={"opened": c.session_id})
        except DuplexProtocolError as refused:
            report.fact(third={"code": refused.code, "error": refused.raw.get("error")})
        await a.close(timeout_s=args.step_timeout)
        report.fact(a_closed=a_frames.first("session.closed"))
        try:
            async with d:
                report.fact(replacement={"opened": d.session_id})
        except DuplexProtocolError as refused:
            report.fact(replacement={"code": refused.code, "error": refused.raw.get("error")})


async def barge_in_example(args: argparse.Namespace, report: Report) -> None:
    """The scenario of upstream's examples/online_serving/barge_in_client.py (preset `none`:
    SessionConfig(), so auto_response, no VAD), with the client's own helpers: the question
    streamed at real-time pace in 100 ms appends and committed with create_response=False;
    about 2 s of the answer listened to; a follow-up streamed over it and committed the same
    way. The answer is barged in, or the remark deferred, and a new response answers it."""
    client, _ = report.client("a", SessionConfig(), reconnect=None, heartbeat_interval_s=None)
    pcm = speech(args)
    question, follow_up = pcm * 3, pcm
    async with client:
        collector, collecting = await consume(client)
        await client.stream_pcm(question, chunk_ms=100)
        await client.commit(create_response=False)
        await condition(
            "the first response.created",
            lambda: collector.count("response.created") > 0,
            args.step_timeout,
        )
        first = collector.response_ids[0]
        # listen as a user would: about 2 s of the answer (its audio, not the wall clock)
        await condition(
            "2 s of the answer",
            lambda: len(collector.audio_bytes(first)) >= 2000 * OUTPUT_BYTES_PER_MS,
            args.step_timeout,
        )
        before = set(collector.response_ids)
        first_done_before = collector.response_is_done(first)
        await client.stream_pcm(follow_up, chunk_ms=100)
        await client.commit(create_response=False)
        await condition(
            "response.done of a response to the follow-up",
            lambda: any(
                e.get("type") == "response.done" and collector.response_id(e) not in before
                for e in collector.events
            ),
            args.step_timeout,
        )
        await acknowledge_collected_playback(client, collector)
        await client.close(timeout_s=args.step_timeout)
        await within("the collector", collecting, 5)

    responses = []
    for response_id in collector.response_ids:
        done = next(
            (
                e
                for e in collector.events
                if e.get("type") == "response.done" and collector.response_id(e) == response_id
            ),
            {},
        )
        body = done.get("response") or {}
        responses.append(
            {
                "id": response_id,
                "after_follow_up": response_id not in before,
                "status": body.get("status"),
                "reason": (body.get("status_details") or {}).get("reason"),
                "audio_ms": len(collector.audio_bytes(response_id)) / OUTPUT_BYTES_PER_MS,
                "text": collector.response_text(response_id),
            }
        )
    report.fact(
        question_ms=len(question) / 32,
        follow_up_ms=len(follow_up) / 32,
        first_done_before_follow_up=first_done_before,
        responses=responses,
        overlap=[
            {k: v for k, v in e.items() if k in ("action", "policy", "reason")}
            for e in collector.events
            if e.get("type") == "overlap.decision"
        ],
        acks=[
            without_audio(e.get("event"))
            for e in collector.events
            if e.get("type") == "playback.acknowledged"
        ],
    )


SCENARIOS = {
    "open": open_session,
    "auto_turn": auto_turn,
    "explicit_turns": explicit_turns,
    "playback_ack": playback_ack,
    "cancel": cancel,
    "barge_in": barge_in,
    "resume": resume,
    "takeover": takeover,
    "expiry": expiry,
    "close": close,
    "admission": admission,
    "barge_in_example": barge_in_example,
}

if __name__ == "__main__":
    run(SCENARIOS)
