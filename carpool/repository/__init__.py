"""User models from a model repository: Triton's layout (``config.pbtxt`` and a
Python-backend ``model.py``) and carpool's own (``carpool.toml``), each read into one
``ModelSpec`` and run behind a dynamic batcher like any built-in model."""
