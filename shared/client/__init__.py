"""Clients: DuplexClient (WebSocket, automatic resume) and the inline (in-process) client."""
