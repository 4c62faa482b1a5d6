"""The API pod: FastAPI app, WebSocket handler, attachment/resume/replay, janitor jobs."""
