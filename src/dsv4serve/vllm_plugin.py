"""dsv4serve's vLLM general plugin (entry point `vllm.general_plugins: dsv4serve`).

Inert unless dsv4serve launched the process (DSV4SERVE_RUN_ID set): a user's unrelated vLLM run
in the same environment is never changed.
"""

from __future__ import annotations

import os


def register() -> None:
    if not os.environ.get("DSV4SERVE_RUN_ID"):
        return
