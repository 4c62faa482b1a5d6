"""The worker's control plane: the sessions this worker holds (their table), admitting,
closing and moving them; it builds each session's engine (`services.worker.engine`)."""
