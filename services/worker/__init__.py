"""The worker pod: the process (registry/heartbeat, inbox consumer, publisher, drain) at this
level, above its three places: the control plane (`control`), the session engine (`engine`)
and the model stages (`stages`)."""
