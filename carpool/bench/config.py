"""``carpool bench``'s knobs (vLLM's ``vllm bench serve`` names where it has one).
Imports nothing beyond the standard library: the CLI builds its parser from it."""

from __future__ import annotations

import ipaddress
import math
import urllib.parse
from dataclasses import dataclass

from carpool.bench.metrics import METRICS
from carpool.bench.workload import DATASETS
from carpool.config import _help, _require

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


@dataclass(frozen=True)
class BenchConfig:
    """Load for any OpenAI-compatible server: closed loop (--concurrency) or open loop
    (--request-rate, Poisson or gamma arrivals), optionally swept."""

    base_url: str = _help(
        "The server, e.g. http://127.0.0.1:8000.", default="http://127.0.0.1:8000"
    )
    endpoint: str = _help(f"One of {', '.join(ENDPOINTS)}.", default="/v1/completions")
    model: str = _help("The model name the server serves.", default="smollm2-135m-instruct")
    api_key: str = _help("Sent as 'Authorization: Bearer <key>' when set.", default="")
    dataset: str = _help(
        "random, sharegpt (ShareGPT-shaped lengths), prefix (shared prefixes) or jsonl.",
        default="random",
    )
    dataset_path: str = _help("The JSONL file for --dataset jsonl.", default="")
    num_prompts: int = _help("Timed requests per run.", default=100)
    num_warmups: int = _help("Untimed requests first, on prompts never reused.", default=2)
    random_input_len: int = _help("Words per prompt (random dataset).", default=256)
    random_output_len: int = _help("Tokens asked per request (random, prefix).", default=128)
    random_range_ratio: float = _help(
        "Lengths are uniform within this ratio of the asked ones.", default=0.0
    )
    prefix_len: int = _help("Words of each shared prefix (prefix dataset).", default=512)
    num_prefixes: int = _help("Distinct shared prefixes (prefix dataset).", default=4)
    suffix_len: int = _help("Words after the prefix (prefix dataset).", default=32)
    concurrency: int = _help(
        "Closed loop: this many clients, each sending its next request when its last "
        "one ends (0: open loop at --request-rate).",
        default=0,
    )
    request_rate: float = _help(
        "Open loop: requests per second (inf: all at once).", default=math.inf
    )
    burstiness: float = _help(
        "Gamma arrivals' shape: 1 is Poisson, lower is burstier.", default=1.0
    )
    max_concurrency: int = _help("Open loop: most requests in flight (0: no cap).", default=0)
    sweep_request_rates: tuple[float, ...] = _help(
        "Run once per request rate (open loop), each on fresh prompts.", default=()
    )
    sweep_concurrencies: tuple[int, ...] = _help(
        "Run once per concurrency (closed loop), each on fresh prompts.", default=()
    )
    ignore_eos: bool = _help("Ask the server to ignore EOS (vLLM's extension).", default=False)
    temperature: float = _help("Sampling temperature sent with each request.", default=0.0)
    percentiles: tuple[float, ...] = _help(
        "Percentiles reported for each metric.", default=(50.0, 90.0, 99.0)
    )
    goodput: tuple[str, ...] = _help(
        "SLOs as metric:ms (ttft, tpot, e2el), e.g. ttft:2000 tpot:100.", default=()
    )
    seed: int = _help("Seed of the prompts and the arrivals.", default=0)
    timeout_s: float = _help("Bound of one run; what is still out then fails.", default=1800.0)
    result_file: str = _help("Write the results as JSON here.", default="")
    plot_dir: str = _help("Write PNG figures here (needs matplotlib).", default="")
    loopback_only: bool = _help(
        "Refuse a --base-url that is not this machine (localhost, 127.0.0.0/8, ::1).",
        default=False,
    )

    def __post_init__(self) -> None:
        _require(self.endpoint in ENDPOINTS, f"endpoint must be one of {ENDPOINTS}")
        _require(
            not self.loopback_only or is_loopback(self.base_url),
            f"base_url {self.base_url!r} is not this machine (loopback_only is set)",
        )
        _require(self.dataset in DATASETS, f"dataset must be one of {DATASETS}")
        _require(
            self.dataset != "jsonl" or bool(self.dataset_path), "dataset jsonl needs dataset_path"
        )
        _require(self.num_prompts >= 1, "num_prompts must be >= 1")
        _require(self.num_warmups >= 0, "num_warmups must be >= 0")
        _require(self.concurrency >= 0 and self.max_concurrency >= 0, "concurrency must be >= 0")
        _require(self.request_rate > 0, "request_rate must be > 0 (inf: all at once)")
        _require(self.burstiness > 0, "burstiness must be > 0")
        _require(0 <= self.random_range_ratio < 1, "random_range_ratio must be in [0, 1)")
        _require(all(r > 0 for r in self.sweep_request_rates), "request rates must be > 0")
        _require(all(c >= 1 for c in self.sweep_concurrencies), "concurrencies must be >= 1")
        _require(all(0 < q < 100 for q in self.percentiles), "percentiles must be in (0, 100)")
        for slo in self.goodput:
            name, _, value = slo.partition(":")
            _require(
                name in METRICS and name != "itl" and _is_number(value) and float(value) > 0,
                f"goodput {slo!r}: want ttft:MS, tpot:MS or e2el:MS",
            )

    def slos_ms(self) -> dict[str, float]:
        return {s.split(":")[0]: float(s.split(":")[1]) for s in self.goodput}


def is_loopback(url: str) -> bool:
    """Whether ``url``'s host is this machine: localhost or a loopback address."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
