"""Golden token lists of the reference MiniCPM-o 4.5 on the tiny checkpoint, and their inputs
(README.md says how they were made)."""
