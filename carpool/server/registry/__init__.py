"""The served models of every kind, and model control (loading, unloading)."""
