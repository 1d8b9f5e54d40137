"""Model repositories the tests build: Triton Python-backend models and carpool.toml
classes, written into a temporary folder (``build``)."""
