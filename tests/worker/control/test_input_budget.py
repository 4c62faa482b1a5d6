"""The pending-input budget counts decoded samples, bad WAV headers are refused at submit,
and only appends small in output run on the event loop (issue 14)."""

import struct
import threading

from harness.sessions import appends, make_harness, send_all, sine, types
from services.worker.engine.input_pipeline import InputPipeline
from shared.protocol.duplex import AppendAudio, float_to_pcm16


def wav(payload: bytes, rate: int, *, tag: int = 1, bits: int = 16) -> bytes:
    block = bits // 8
    fmt = struct.pack("<HHIIHH", tag, 1, rate, rate * block & 0xFFFFFFFF, block, bits)
    chunks = b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(payload))
    return b"RIFF" + struct.pack("<I", 4 + len(chunks) + len(payload)) + b"WAVE" + chunks + payload


def append(audio: bytes, fmt: str = "pcm16", rate: int = 16000, **fields) -> AppendAudio:
    return AppendAudio(audio=audio, format=fmt, sample_rate_hz=rate, **fields)


async def test_reservation_is_the_decoded_float32_size(harness):
    session = await harness.open()
    pending = harness.manager.table.runner(session.session_id).session

    async def reserved_for(command: AppendAudio) -> int:
        before = pending.pending_input_bytes
        # submit does not yield: the runner has not taken the append yet
        await harness.manager.submit(session.session_id, command)
        return pending.pending_input_bytes - before

    # 100 ms of 8 kHz G.711 is 800 bytes, and 1600 samples (6400 bytes) at 16 kHz
    assert await reserved_for(append(bytes(800), "g711_ulaw", 8000)) == 6400
    assert await reserved_for(append(wav(bytes(800), 8000, tag=7, bits=8))) == 6400
    assert await reserved_for(append(bytes(3200), "pcm16", 16000)) == 6400
    # downsampled input keeps its payload size when that is larger (it waits in memory too)
    assert await reserved_for(append(bytes(9600), "pcm16", 48000)) == 9600
    # decoded video frame bytes still count on top: "QUJD" is 3 bytes
    assert await reserved_for(append(bytes(3200), video_frames=("QUJD",))) == 6403


async def test_a_small_payload_that_decodes_big_is_backpressured():
    h = make_harness(max_pending_input_bytes_per_session=60_000)
    try:
        session = await h.open()
        # 8 000 bytes of G.711 fit the old byte count; decoded they are 64 000 bytes
        await session.send(append(bytes(8000), "g711_ulaw", 8000, event_id="one-second"))
        error = await session.recv()
        assert (error.code, error.related_event_id) == ("input_backpressure", "one-second")
        assert h.manager.table.runner(session.session_id).session.pending_input_bytes == 0
    finally:
        await h.manager.shutdown()


async def test_a_hostile_wav_header_is_refused_at_submit_and_the_session_goes_on(harness):
    session = await harness.open()
    runner = harness.manager.table.runner(session.session_id)
    for event_id, payload in (
        ("one-hz", wav(bytes(6 * 1024), 1)),
        ("huge-rate", wav(bytes(6 * 1024), 0xFFFFFFFF)),
        ("twelve-bit", wav(bytes(6 * 1024), 16000, bits=12)),
    ):
        await session.send(append(payload, event_id=event_id))
        assert runner.session.pending_input_bytes == 0  # nothing reserved, nothing scheduled
        assert runner.input.queue.idle
        error = await session.recv()
        assert (error.code, error.param, error.related_event_id) == (
            "unsupported_audio_format",
            "audio",
            event_id,
        )
    await send_all(session, appends(sine(16000, 0.2), 16000))
    await session.send({"type": "input.commit"})
    events = await session.until("rate_limits.updated")
    assert "error" not in types(events)
    transcript = next(e for e in events if e.wire_type == "response.output_audio_transcript.done")
    assert transcript.transcript == "echo 200 ms"


def test_runs_inline_decides_on_the_output_size():
    at_16k, at_24k = InputPipeline(16000, None), InputPipeline(24000, None)
    assert at_16k.runs_inline(append(bytes(8192)))  # 4096 samples out
    assert not at_16k.runs_inline(append(bytes(8194)))  # payload bound kept
    assert at_16k.runs_inline(append(bytes(8192), "pcm16", 48000))  # 1366 samples out
    # same payload sizes, 4x more output: off the loop
    assert not at_16k.runs_inline(append(bytes(8192), "g711_ulaw", 8000))
    assert not at_16k.runs_inline(append(wav(bytes(6000), 8000, tag=7, bits=8)))
    assert not at_24k.runs_inline(append(bytes(8192)))  # 6144 samples out
    assert at_16k.decoded_samples(append(bytes(8192), "g711_ulaw", 8000)) == 16384


async def test_appends_big_in_output_are_converted_off_the_event_loop(harness):
    session = await harness.open()
    pipeline = harness.manager.table.runner(session.session_id).pipeline
    threads: list[str] = []
    convert = pipeline.convert

    def spy(command, silence_rms):
        threads.append(threading.current_thread().name)
        return convert(command, silence_rms)

    pipeline.convert = spy
    await session.send(append(float_to_pcm16(sine(16000, 0.02))))  # 320 samples: inline
    await session.send(append(bytes(8000), "g711_ulaw", 8000))  # 16 000 samples: executor
    await session.send({"type": "input.commit"})
    await session.until("rate_limits.updated")
    assert threads[0] == threading.current_thread().name
    assert threads[1].startswith("duplex-session")


async def test_a_refused_video_only_append_gives_its_reservation_back(harness):
    """Echo needs audio with every video frame: the refused append's reserved bytes are
    given back, so the session is not left busy for ever with a shrunken budget."""
    session = await harness.open()
    state = harness.manager.table.runner(session.session_id).session
    await session.send(append(b"", video_frames=("QUJD",), event_id="video-only"))
    error = await session.recv()
    assert (error.code, error.related_event_id) == ("invalid_video_frames", "video-only")
    assert state.pending_input_bytes == 0
    assert not state.busy  # an idle session may expire again


async def test_a_cancel_ahead_in_the_mailbox_does_not_drive_the_budget_below_zero(harness):
    """input.cancel, then an append and a commit, submitted in one inbox batch: both were
    reserved before the cancel ran and zeroed the budget. Their releases must not take the
    budget below zero (it went to -6400 bytes and -1 turn: limits loosened, busy lost)."""
    from shared.protocol.duplex import CancelInput, Commit

    session = await harness.open({"model": "echo", "extra_body": {"pace": 0}})
    state = harness.manager.table.runner(session.session_id).session
    for command in (CancelInput(), append(bytes(3200)), Commit(create_response=False)):
        await harness.manager.submit(session.session_id, command)  # no yield in between
    events = await session.until("input_audio_buffer.committed")
    assert "input_audio_buffer.committed" in types(events)
    assert (state.pending_input_bytes, state.pending_commits) == (0, 0)
