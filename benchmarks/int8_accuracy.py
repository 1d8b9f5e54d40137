"""The accuracy bar of ``--weight-kernel native-int8``: the built-in model's perplexity
on a fixed text, with each weight kernel, side by side in one run.

The text is the GNU GPL version 3 as Debian and Ubuntu ship it
(``/usr/share/common-licenses/GPL-3``), its first ``--tokens`` tokens, in windows of
``--window`` tokens each scored from its own start. Prompts are prefilled 8 rows a
step, as decode and verification steps are (int8 gives a row the same bits in a step
of any size where a weight is interleaved; a weight that is not keeps int8 for steps
of up to 8 rows only).

    python -m benchmarks.int8_accuracy [--tokens 2048] [--window 512]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from carpool.config import EngineConfig
from carpool.engine.sampling_params import SamplingParams
from carpool.models import registry
from carpool.models.causal_lm import LoadedLM
from carpool.models.registry import LoadOptions
from carpool.workers.factory import engine_for

MODEL = "smollm2-135m-instruct"
TEXT = Path("/usr/share/common-licenses/GPL-3")


def token_logprobs(lm: LoadedLM, window: list[int]) -> list[float]:
    """Each token's log-probability given the ones before it in ``window`` (not the
    first's)."""
    engine = engine_for(lm, EngineConfig(kv_cache_memory="128MiB", max_num_batched_tokens=8))
    engine.add_request("w", window, SamplingParams(max_tokens=1, prompt_logprobs=0))
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                return [entry.logprob for entry in out.prompt_logprobs[1:]]
    raise RuntimeError("the window did not finish")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--kernels", nargs="+", default=["native", "native-int8", "torch"])
    args = parser.parse_args()
    print("command: python -m benchmarks.int8_accuracy " + " ".join(sys.argv[1:]))
    source = registry.resolve(MODEL)
    results: dict[str, list[float]] = {}
    for kernel in args.kernels:
        lm = registry.load(source, LoadOptions(weight_kernel=kernel))
        tokens = lm.tokenizer.encode(args.text.read_text())[: args.tokens]
        windows = [tokens[i : i + args.window] for i in range(0, len(tokens), args.window)]
        results[kernel] = [lp for w in windows if len(w) > 1 for lp in token_logprobs(lm, w)]
    base = results[args.kernels[0]]
    print(f"{args.text}, {len(base)} scored tokens, windows of {args.window}")
    for kernel, logprobs in results.items():
        ppl = math.exp(-sum(logprobs) / len(logprobs))
        moved = sum(abs(a - b) for a, b in zip(logprobs, base, strict=True)) / len(base)
        base_ppl = math.exp(-sum(base) / len(base))
        print(
            f"{kernel:12} perplexity {ppl:8.4f} ({ppl / base_ppl - 1:+.2%} against "
            f"{args.kernels[0]}), mean |log-prob change| {moved:.4f}"
        )


if __name__ == "__main__":
    main()
