"""The Nemotron plugin's option defaults, in one place for the plugin (which imports no
torch) and the model it builds."""

#: the most frames of a restored history one `replay_work` call may be asked to replay (in
#: one forward: a call's cost is mostly fixed on a small batch, so the longer the cheaper
#: per frame; the stage asks for what the tick's spare time holds)
REPLAY_CHUNK_FRAMES = 128
#: tool-result tokens fed before one frame
MAX_INJECTED_TOKENS = 16
