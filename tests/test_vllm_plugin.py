"""The vLLM plugin's glue, in fresh interpreters (it patches vLLM's loader class for the process).

The plugin's real work inside vLLM workers is exercised by the e2e tests (tests/test_supervisor_e2e.py):
`dsv4serve plugin ready` on every rank of a real TP 2 server, counters files, strict-1 failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

PROBE = r"""
import json, os, sys
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
before = BaseModelLoader.load_model
from dsv4serve import vllm_plugin
vllm_plugin.register(); vllm_plugin.register()
after = BaseModelLoader.load_model
print(json.dumps({"changed": after is not before, "flag": bool(getattr(after, "_dsv4serve_hook", False)),
                  "wrapped_once": getattr(after, "__wrapped__", None) is before}))
"""


def _probe(env_extra: dict[str, str]) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4SERVE_")}
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_entry_point_registered():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "dsv4serve"]
    assert len(eps) == 1 and eps[0].value == "dsv4serve.vllm_plugin:register"


def test_inert_without_run_id():
    doc, err = _probe({})
    assert doc == {"changed": False, "flag": False, "wrapped_once": False}
    assert "dsv4serve" not in err


def test_hook_installed_once_under_dsv4serve():
    doc, err = _probe({"DSV4SERVE_RUN_ID": "t-1", "VLLM_EXL3_MOE_KERNEL": "lna2", "VLLM_EXL3_MOE_STRICT": "1"})
    assert doc == {"changed": True, "flag": True, "wrapped_once": True}
    assert err.count("dsv4serve plugin loaded") == 1
    assert "kernel=lna2 strict=1" in err


def test_bad_env_is_announced_not_swallowed():
    doc, err = _probe({"DSV4SERVE_RUN_ID": "t-1", "VLLM_EXL3_MOE_STRICT": "9"})
    assert doc["changed"]  # the hook is in place, and it raises in the worker at load
    assert "config error: VLLM_EXL3_MOE_STRICT='9' is not 0, 1 or 2" in err
