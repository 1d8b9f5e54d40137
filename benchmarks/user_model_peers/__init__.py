"""The user-model benchmark's servers: the same two models under carpool, LitServe,
Ray Serve and PyTriton (each peer runs in a virtual environment of its own)."""
