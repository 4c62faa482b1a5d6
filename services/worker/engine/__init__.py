"""The session engine: one session's state and how it reacts (its runner, handlers,
controllers, ledgers, surfaces and checkpoint form); it knows nothing of the control plane."""
