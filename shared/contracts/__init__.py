"""Seams between the session engine and models: plugin and stage-port ABCs, config types."""
