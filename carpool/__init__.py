"""carpool: an inference server in which requests share the ride.

``carpool.LLM`` and ``carpool.SamplingParams`` are the offline API;
``carpool.batched`` and ``carpool.serve`` serve a plain Python function, batched;
``carpool.serve`` serves a LitServe ``LitAPI`` instance too (``carpool.lit_api`` sets
its batching).
Each is imported on first use, so ``import carpool`` stays cheap (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from carpool.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__", "batched", "lit_api", "serve"]

if TYPE_CHECKING:
    from carpool.engine.sampling_params import SamplingParams
    from carpool.llm import LLM
    from carpool.repository.function_model import batched, lit_api


def serve(*functions: Any, host: str = "127.0.0.1", port: int = 8000, **flags: Any) -> int:
    """Serve ``carpool.batched`` functions over HTTP (/v2, tritonclient) and LitServe
    ``LitAPI`` instances (at /predict, as ``LitServer(api)`` does; a bare instance
    batches as it was made to, see ``carpool.lit_api``) until a signal; ``flags`` are
    ``carpool serve``'s (``model=[...]`` to serve built-in models beside them,
    ``model_repository=...``). Returns the exit code."""
    from carpool.cli import build_config, parser
    from carpool.cli import serve as serve_config
    from carpool.repository.function_model import FunctionModel, LitApiModel, lit_api

    served = [f if isinstance(f, FunctionModel | LitApiModel) else lit_api(f) for f in functions]

    argv = ["serve", "--host", host, "--port", str(port)]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        values = value if isinstance(value, list | tuple) else [value]
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
            continue
        for item in values:
            argv += [flag, str(item)]
    args = parser().parse_args(argv)
    if "model" not in flags and args.__dict__.get("server.models") is None:
        args.__dict__["server.models"] = ()
    config = build_config(args, allow_empty=bool(served))
    return serve_config(config, served)


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from carpool.llm import LLM

        return LLM
    if name == "SamplingParams":
        from carpool.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "batched":
        from carpool.repository.function_model import batched

        return batched
    if name == "lit_api":
        from carpool.repository.function_model import lit_api

        return lit_api
    raise AttributeError(f"module 'carpool' has no attribute {name!r}")
