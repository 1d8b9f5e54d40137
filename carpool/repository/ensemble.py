"""Triton's ensembles (``platform: "ensemble"``): a model that is a graph of other
repository models. ``ensemble_scheduling { step [...] }`` names each step's model,
and maps the ensemble's tensors to the step model's inputs (``input_map``: model
input -> ensemble tensor) and its outputs back (``output_map``: model output ->
ensemble tensor). Read and checked here, before anything runs: every tensor a step
reads is the ensemble's input or another step's output, no tensor is written twice,
every ensemble output is written, and the steps form no cycle."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from carpool.repository.errors import RepositoryError


@dataclass(frozen=True)
class EnsembleStep:
    """One step: ``model`` (its ``version``; empty: the newest) reads ensemble tensors
    into its inputs (``inputs``: model input -> tensor) and writes its outputs
    (``outputs``: model output -> tensor)."""

    model: str
    version: str
    inputs: Mapping[str, str]
    outputs: Mapping[str, str]


def read_steps(
    config: Mapping[str, Any], inputs: list[str], outputs: list[str], where: str
) -> tuple[tuple[EnsembleStep, ...], ...]:
    """The steps of an ensemble config in stages: each stage's steps read only what
    the ensemble's ``inputs`` and earlier stages give, so a stage's steps may run at
    once. ``RepositoryError`` naming what is wrong."""
    entries = config.get("ensemble_scheduling", {}).get("step", [])
    if not entries:
        raise RepositoryError(f"{where}: an ensemble needs ensemble_scheduling with a step")
    steps = [_step(entry, where) for entry in entries]
    written: dict[str, str] = {}
    for step in steps:
        for tensor in step.outputs.values():
            if tensor in written or tensor in inputs:
                raise RepositoryError(
                    f"{where}: ensemble tensor '{tensor}' is written by step '{step.model}' "
                    f"and by {'an input' if tensor in inputs else repr(written[tensor])}"
                )
            written[tensor] = step.model
    missing = [name for name in outputs if name not in written]
    if missing:
        raise RepositoryError(f"{where}: no step writes the ensemble output '{missing[0]}'")
    return _stages(steps, set(inputs), written, where)


def _step(entry: Mapping[str, Any], where: str) -> EnsembleStep:
    model = entry.get("model_name", "")
    if not model:
        raise RepositoryError(f"{where}: an ensemble step has no model_name")
    version = int(entry.get("model_version", -1))
    if version < -1 or version == 0:
        raise RepositoryError(f"{where}: step '{model}': model_version must be -1 or positive")
    inputs = dict(entry.get("input_map", {}))
    outputs = dict(entry.get("output_map", {}))
    if not inputs or not outputs:
        raise RepositoryError(f"{where}: step '{model}' needs an input_map and an output_map")
    return EnsembleStep(model, "" if version == -1 else str(version), inputs, outputs)


def _stages(
    steps: list[EnsembleStep], given: set[str], written: dict[str, str], where: str
) -> tuple[tuple[EnsembleStep, ...], ...]:
    known = set(given)
    left = list(steps)
    stages = []
    while left:
        ready = [s for s in left if set(s.inputs.values()) <= known]
        if not ready:
            step = left[0]
            unread = next(t for t in step.inputs.values() if t not in known)
            if unread in written:
                raise RepositoryError(
                    f"{where}: the ensemble's steps form a cycle (step '{step.model}' reads "
                    f"'{unread}', written by '{written[unread]}')"
                )
            raise RepositoryError(
                f"{where}: step '{step.model}' reads '{unread}', which neither an ensemble "
                "input nor a step gives"
            )
        stages.append(tuple(ready))
        for step in ready:
            known |= set(step.outputs.values())
        left = [s for s in left if s not in ready]
    return tuple(stages)
