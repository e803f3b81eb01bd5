"""What one request to `fastllm serve` may ask for (each limit a flag of the command, same name), who may
ask (the API key's environment variable), and how long open requests may run on at shutdown."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 16 << 20  # a larger request body is refused (413), before it is read
    max_n: int = 128  # samples per prompt (OpenAI's own limit)
    max_prompts: int = 256  # prompts in one /v1/completions request

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"--{f.name.replace('_', '-')} must be an integer >= 1, got {value!r}")


API_KEY_ENV = "FASTLLM_API_KEY"  # --api-key's default
SHUTDOWN_TIMEOUT_S = 5.0  # --shutdown-timeout's default


def check_shutdown_timeout(seconds: float) -> None:
    if isinstance(seconds, bool) or not (isinstance(seconds, (int, float)) and 0 <= seconds < math.inf):
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {seconds!r}")


HELP = {
    "max_request_bytes": "largest request body in bytes (413 above it)",
    "max_n": "most samples (n) per prompt",
    "max_prompts": "most prompts in one /v1/completions request",
}
