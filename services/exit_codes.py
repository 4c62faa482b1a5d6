"""The exit statuses of the `duplex` commands, in a leaf module: the CLI (`services.cli`)
and the admin commands it runs (`services.admin`) both name them, and neither imports the
other for it (the CLI imports the admin commands lazily)."""

#: Redis (or what a command needs) is unreachable; docs/operations.md lists every status
EXIT_NOT_AVAILABLE = 3
