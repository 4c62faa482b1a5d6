"""Redis: the key schema (one module builds every key), Lua scripts, typed wrappers."""
