"""DuplexClient behaviour that needs no server."""


async def test_close_returns_while_the_connection_never_comes_back():
    """A session.close sent while a resume is failing waits for a connection; close() must
    give up after its timeout instead of hanging (bench/chaos found it under CPU load)."""
    import time

    from shared.client.duplex_client import DuplexClient

    client = DuplexClient("ws://127.0.0.1:9")
    client.close_timeout_s = 0.2
    client._ws = object()  # "connected once", and `_connected` is never set again
    started = time.monotonic()
    await client.close()
    assert time.monotonic() - started < 2


class FakeSocket:
    """A connection whose send fails as a killed pod's does, or records what it sent."""

    def __init__(self, dead: bool) -> None:
        self.dead = dead
        self.sent: list[str] = []

    async def send(self, data: str) -> None:
        if self.dead:
            from websockets.exceptions import ConnectionClosedError

            raise ConnectionClosedError(None, None)  # "no close frame received or sent"
        self.sent.append(data)


async def test_a_send_that_fails_before_the_reader_notices_waits_for_the_resume():
    """A write to a killed pod can fail before the reader sees the close, while the client
    still counts itself connected: the command must go out on the resumed connection,
    not fail (bench/chaos, test_killing_api_pods, under load)."""
    import asyncio

    from shared.client.duplex_client import DuplexClient
    from shared.protocol.duplex import Heartbeat

    client = DuplexClient("ws://127.0.0.1:9")
    dead, resumed = FakeSocket(dead=True), FakeSocket(dead=False)
    client._ws = dead
    client._connected.set()  # the reader has not noticed yet
    sending = asyncio.create_task(client._send_raw(Heartbeat(event_id="hb")))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not sending.done()  # waiting for a new connection, not retrying the dead one
    client._connected.clear()  # what the reader does, then resumes:
    client._ws = resumed
    client._relink()
    client._connected.set()
    await sending
    assert len(resumed.sent) == 1 and '"hb"' in resumed.sent[0]


async def test_a_send_waiting_for_a_resume_hears_that_it_failed():
    import asyncio

    import pytest

    from shared.client.duplex_client import DuplexClient, DuplexClientError
    from shared.protocol.duplex import Heartbeat

    client = DuplexClient("ws://127.0.0.1:9")
    client._ws = FakeSocket(dead=True)
    client._connected.set()
    sending = asyncio.create_task(client._send_raw(Heartbeat(event_id="hb")))
    await asyncio.sleep(0)
    client._failure = DuplexClientError("session_resume_expired", "gone")
    client._relink()
    with pytest.raises(DuplexClientError):
        await sending


async def test_an_ack_the_ended_session_cannot_take_is_dropped_without_noise():
    """Acks are sent in the background: when the session's resume was refused, the ack's
    failure must not surface as 'Task exception was never retrieved' (bench.exhaustion
    printed one per ended session)."""
    import asyncio
    import gc

    from shared.client.duplex_client import DuplexClient, DuplexClientError

    unretrieved = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    client = DuplexClient("ws://127.0.0.1:9", ack_every=1)
    client._ws = FakeSocket(dead=True)
    client._connected.set()
    client._deliver({"type": "response.done", "server_event_seq": 1, "response": {}})
    [ack] = client._acks
    await asyncio.sleep(0)
    client._failure = DuplexClientError("session_resume_expired", "gone")
    client._relink()
    async with asyncio.timeout(10):
        while not ack.done():  # done, and nobody awaits it (what retrieves an exception)
            await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert client._acks == set()
    del ack
    gc.collect()
    assert unretrieved == []


async def test_a_resume_refused_as_retryable_is_tried_again():
    """A pod whose session store is failing over answers a resume `internal_error`,
    retryable (nothing was taken over): the client tries again, where it used to give the
    session up; a refusal that is not retryable still ends it."""
    import asyncio

    import orjson
    import pytest
    import websockets

    from shared.client.duplex_client import DuplexClient, DuplexClientError, ReconnectPolicy

    answers: list[dict] = []

    async def pod(ws) -> None:
        await ws.recv()  # the session.resume
        await ws.send(orjson.dumps(answers.pop(0)).decode())
        await ws.wait_closed()

    retryable = {"type": "error", "error": {"code": "internal_error", "retryable": True}}
    final = {"type": "error", "error": {"code": "invalid_resume_token"}}
    resumed = {"type": "session.resumed", "session_id": "duplex-r", "resume_token": "t2",
               "attachment_generation": 2, "session": {}}
    async with websockets.serve(pod, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        client = DuplexClient(f"http://127.0.0.1:{port}")
        client.reconnect_policy = ReconnectPolicy(initial_backoff_s=0.01, max_backoff_s=0.02)
        client.session_id, client.resume_token = "duplex-r", "t1"
        answers[:] = [retryable, retryable, resumed]
        await client._resume()
        assert (client.resumes, client.resume_token, answers) == (1, "t2", [])
        await client._ws.close()
        answers[:] = [retryable, final]
        with pytest.raises(DuplexClientError) as refused:
            await client._resume()
        assert refused.value.args[0] == "invalid_resume_token"
        await asyncio.sleep(0)
