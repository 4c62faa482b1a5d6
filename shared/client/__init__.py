"""Clients: the inline (in-process) client now; DuplexClient (WebSocket, resume) with the API."""
