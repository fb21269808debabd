"""The seat workflow: profile -> launch spec -> supervisor -> gates, and the renderers the CLI uses.

Each step lives in its own module; this one only sequences them.
"""

from __future__ import annotations

from typing import Any

from dsv4serve import launch
from dsv4serve.cli_common import console
from dsv4serve.profile import Profile, load_profile


def load(ref: str, overrides: list[str] | None = None) -> Profile:
    return load_profile(ref, overrides)


def patch_plan(profile: Profile) -> list[dict[str, Any]]:
    try:
        from dsv4serve import patches
    except ImportError:
        return [{"set": s, "state": "unknown (patch support not installed)"} for s in profile.patches]
    plan_fn = getattr(patches, "profile_plan", None)
    if plan_fn is None:
        return [{"set": s, "state": "unknown"} for s in profile.patches]
    return plan_fn(profile)


def dry_run(profile: Profile, validate: bool = True) -> dict[str, Any]:
    from dsv4serve import home

    run_dir = home.runs_dir() / "<run-id>"
    spec = launch.build(profile, run_id="<run-id>", run_dir=run_dir)
    parser = {"checked": False, "detail": "skipped (--no-validate)"}
    if validate:
        from dsv4serve import vllm_args

        res = vllm_args.validate(spec.vllm_args, profile.name)
        parser = {"checked": res.available, "vllm_version": res.vllm_version, "detail": res.detail}
    return {
        "profile": profile.name,
        "digest": profile.digest(),
        "runtime": spec.runtime,
        "argv": spec.argv,
        "env": spec.env,
        "command": spec.shell(),
        "endpoint": f"http://{spec.host}:{spec.port}/v1",
        "served_name": spec.served_name,
        "model_path": spec.model_path,
        "patches": patch_plan(profile),
        "gates": launch.describe_gates(profile),
        "vllm_parser": parser,
    }


def render_plan(plan: dict[str, Any]) -> None:
    console.print(f"[bold]dry run[/] profile {plan['profile']} ({plan['runtime']}, digest {plan['digest']}); "
                  "nothing was started", highlight=False)
    console.print("\n[bold]command[/]")
    console.print(plan["command"], highlight=False, markup=False, soft_wrap=True)
    console.print("\n[bold]env delta[/]")
    for k, v in plan["env"].items():
        console.print(f"  {k}={v}", highlight=False, markup=False)
    if not plan["env"]:
        console.print("  (passed with -e inside the docker argv)")
    console.print("\n[bold]patch plan[/]")
    for row in plan["patches"] or [{"set": "(none)", "state": "no patch sets in this profile"}]:
        console.print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), highlight=False, markup=False)
    g = plan["gates"]
    console.print("\n[bold]gates up will wait for[/]")
    for m in g["markers"]:
        console.print(f"  marker '{m['text']}' on {m['ranks']} distinct ranks", highlight=False, markup=False)
    if g["kv_cache_min_tokens"]:
        console.print(f"  KV cache >= {g['kv_cache_min_tokens']:,} tokens", highlight=False)
    for f in g["forbidden"]:
        console.print(f"  forbidden /{f}/", highlight=False, markup=False)
    for r in g["readiness"]:
        console.print(f"  {r}", highlight=False, markup=False)
    t = g["timeouts"]
    console.print(f"  stall {t['stall_s']:.0f} s, hard cap {t['total_s']:.0f} s", highlight=False)
    console.print(f"\n[bold]vLLM parser[/]: {plan['vllm_parser']['detail']}", highlight=False)
