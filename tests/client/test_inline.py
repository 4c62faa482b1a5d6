"""The inline client reads JSON commands with the session's declared formats."""

import base64

import numpy as np

from harness.sessions import sine
from shared.protocol.duplex import float_to_int16, int16_to_ulaw


async def test_json_appends_use_the_sessions_input_format(harness):
    session = await harness.open({"input_audio_format": "g711_ulaw", "extra_body": {"pace": 0}})
    ulaw = int16_to_ulaw(float_to_int16(sine(8000, 0.5)))
    for start in range(0, len(ulaw), 160):
        chunk = base64.b64encode(ulaw[start : start + 160]).decode()
        await session.send({"type": "input_audio_buffer.append", "audio": chunk})
    await session.send('{"type":"input.commit"}')
    events = await session.until("rate_limits.updated")
    transcript = next(
        e for e in events if e.wire_type == "response.output_audio_transcript.done"
    ).transcript
    assert transcript == "echo 500 ms"  # 4000 µ-law bytes at 8 kHz, not 4000 pcm16 bytes at 16 kHz


async def test_session_updates_change_the_defaults_the_client_uses(harness):
    session = await harness.open()
    await session.send({"type": "session.update", "session": {"input_audio_format": "pcm_f32le"}})
    assert (await session.recv()).wire_type == "session.updated"
    pcm = sine(16000, 0.25).astype("<f4").tobytes()
    await session.send(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
    )
    await session.send({"type": "input.commit"})
    events = await session.until("rate_limits.updated")
    assert next(
        e for e in events if e.wire_type == "response.output_audio_transcript.done"
    ).transcript == ("echo 250 ms")
    assert np.isclose(events[-2].response["metadata"]["playback"]["generated_ms"], 250)
