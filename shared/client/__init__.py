"""Clients: DuplexClient (WebSocket, reconnect + resume) and the in-process inline client."""
