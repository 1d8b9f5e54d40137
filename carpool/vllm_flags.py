"""The ``vllm serve`` command line, read by ``carpool serve``: a positional model and
the flags vLLM's users copy that carpool has no flag of its own for. Each is mapped to
carpool's meaning or refused with what to use instead; the flags carpool shares with
vLLM (``--served-model-name``, ``--max-model-len``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--gpu-memory-utilization``, ``--dtype``,
``--kv-cache-dtype`` (but its fp8 kinds), ``--api-key``, ``--chat-template``,
``--reasoning-parser``, ``--enable-prefix-caching``, ``--generation-config``) are
carpool's own.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

# vLLM's dtype names that carpool spells otherwise.
DTYPES = {"half": "float16", "float": "float32"}
# Tool-call parsers whose format carpool reads: hermes <tool_call> blocks, where the
# chat template writes them (carpool picks the form from the template itself).
TOOL_PARSERS = ("hermes",)


@dataclass
class Translation:
    """What the vLLM flags ask of carpool: a model to serve first, engine config
    values, and what to tell the user."""

    model: str | None = None
    engine: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class FlagError(ValueError):
    """A vLLM flag carpool cannot honour; the message says what to use instead."""


def add_flags(serve: argparse.ArgumentParser) -> None:
    """The positional model and vLLM's flags that carpool has no flag of its own for."""
    serve.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a model to serve, as `vllm serve MODEL` takes it (the same as --model MODEL)",
    )
    group = serve.add_argument_group(
        "vllm serve's flags", "Accepted so that a vLLM command line runs as it is."
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted: carpool always lets the model choose a tool (tool_choice auto)",
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        help="hermes (read from the chat template, as carpool does anyway); others refused",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="1 only: one device per process (use --replicas to serve from more)",
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted: carpool runs no code from a model's folder",
    )
    for flag in ("--disable-log-requests", "--disable-log-stats"):
        group.add_argument(flag, action="store_true", help="accepted; carpool logs neither")


def translate(args: argparse.Namespace) -> Translation:
    """The config values and notes the vLLM flags in ``args`` ask for; raises
    ``FlagError`` for one carpool cannot honour."""
    out = Translation(model=args.model_positional)
    dtype = getattr(args, "engine.dtype", None)
    if dtype in DTYPES:
        out.engine["dtype"] = DTYPES[dtype]
    if args.tensor_parallel_size not in (None, 1):
        raise FlagError(
            "--tensor-parallel-size: carpool runs a model on one device; serve it from "
            "several with --replicas N instead"
        )
    parser = args.tool_call_parser
    if parser is not None and parser not in TOOL_PARSERS:
        raise FlagError(
            f"--tool-call-parser {parser}: carpool reads hermes <tool_call> blocks where "
            "the chat template writes them, and otherwise constrains replies to its own "
            "JSON wrapper; leave the flag out (or give hermes)"
        )
    if args.trust_remote_code:
        out.notes.append("--trust-remote-code: carpool runs no code from a model's folder")
    return out
