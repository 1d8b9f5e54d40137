"""The task endpoints' bodies: pure functions of scores."""

from __future__ import annotations

import pytest

from carpool.server.tasks.task_shaping import (
    classify_body,
    predict_body,
    rerank_body,
    score_body,
    score_pairs,
)


def test_rerank_orders_by_score_keeps_ties_and_cuts_at_top_n() -> None:
    body = rerank_body("m", ["a", "b", "c", "d"], [0.1, 0.9, 0.5, 0.9], 3, True)
    assert [r["index"] for r in body["results"]] == [1, 3, 2]
    assert body["results"][0] == {"index": 1, "relevance_score": 0.9, "document": {"text": "b"}}
    assert body["id"].startswith("rerank-") and body["model"] == "m"
    bare = rerank_body("m", ["a", "b"], [0.2, 0.1], None, False)
    assert bare["results"] == [
        {"index": 0, "relevance_score": 0.2},
        {"index": 1, "relevance_score": 0.1},
    ]


def test_score_pairs_one_against_many_or_pairwise() -> None:
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q"], "a") == [("q", "a")]
    assert score_pairs(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]
    with pytest.raises(ValueError, match="text_1 has 2"):
        score_pairs(["x", "y"], ["a", "b", "c"])
    assert [d["score"] for d in score_body("m", [0.5, 0.25])["data"]] == [0.5, 0.25]


def test_classify_and_predict() -> None:
    body = classify_body("m", ["neg", "pos"], [[0.3, 0.7], [0.9, 0.1]])
    assert [(d["label"], d["num_classes"]) for d in body["data"]] == [("pos", 2), ("neg", 2)]
    assert predict_body(["neg", "pos"], [[0.3, 0.7]], single=True) == [
        {"score": 0.7, "label": "pos"},
        {"score": 0.3, "label": "neg"},
    ]
    assert len(predict_body(["neg", "pos"], [[0.3, 0.7], [0.5, 0.5]], single=False)) == 2
