"""The harness shared by tests/ and bench/: what both start and feed, never a test case.

- `redis_server`, `redis_cluster`: a real redis-server, and a 3-master Redis Cluster, on free
  loopback ports (started and stopped here, never an external one)
- `processes`: real `duplex api` / `worker` / `serve` processes, awaited ready, stopped, killed
- `sessions`: a SessionManager with the echo model driven by the inline client, and test
  audio (a sine, 20 ms appends, the recorded speech of `data/`)
- `speech`: synthesized speech (espeak-ng) and a client that streams it like a microphone
- `recording_client`: a DuplexClient that records all it receives, its conversations of echo
  turns, and the checks of what it got (lost, duplicated, wrong audio) that tests/e2e and the
  chaos benchmarks make
- `tiny_llama`: the tiny random Llama the vLLM stage runs on (built here, no hub)

Import rules (tests/test_import_boundaries.py): tests and bench import the harness; the
harness imports neither; the product (`shared`, `services`, `plugins`) imports none of the
three. Not part of the wheel: it is imported from a repository checkout (pytest and
`python -m bench.X` run from the repository root, which is on sys.path).
"""
