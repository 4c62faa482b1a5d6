"""Model plugins, one package per model. Plugins import `shared` only."""
