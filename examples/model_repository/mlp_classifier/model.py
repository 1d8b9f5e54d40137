"""A small torch MLP as a carpool Python-class model.

carpool calls ``setup(device)`` once, then ``predict(collate(inputs))`` for every
batch it forms and ``split(output, inputs)`` to hand each request its rows.
"""

from __future__ import annotations

import numpy as np
import torch


class MLPClassifier:
    def __init__(self, features: int, classes: int) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, 64), torch.nn.ReLU(), torch.nn.Linear(64, classes)
        )

    def setup(self, device: str) -> None:
        self.device = torch.device(device)
        self.net.to(self.device).eval()

    def collate(self, inputs: list[dict[str, np.ndarray]]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([i["features"] for i in inputs])).to(self.device)

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return torch.softmax(self.net(batch), dim=-1)

    def split(self, output: torch.Tensor, inputs: list[dict[str, np.ndarray]]) -> list[dict]:
        probabilities = output.cpu().numpy()
        results, start = [], 0
        for request in inputs:
            rows = probabilities[start : start + len(request["features"])]
            start += len(rows)
            results.append({"probabilities": rows, "label": rows.argmax(axis=1).astype(np.int64)})
        return results
