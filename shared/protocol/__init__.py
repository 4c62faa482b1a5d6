"""The client wire codec.

`shared.protocol.realtime` is the OpenAI Realtime API itself (Tier 1) and imports
nothing else of ours. `shared.protocol.duplex` adds our extensions (Tier 2
subclasses and Tier 3) and is the one door the rest of the code base uses.
"""
