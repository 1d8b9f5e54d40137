"""Task routes (rerank, score, classify, predict) on models that do the task."""
