"""Code every duplex-serve process imports. Imports nothing else of ours."""
