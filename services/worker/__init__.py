"""The worker pod: registry/heartbeat, inbox consumer, SessionManager, SessionRunner, stages."""
