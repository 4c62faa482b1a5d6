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
