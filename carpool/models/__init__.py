"""Our own torch model code, weight loading, and the registry of built-in models."""
