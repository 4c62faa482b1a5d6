"""Processes of duplex-serve: the API pod (`services.api`), the worker pod (`services.worker`)."""
