"""``swiftkv fleet``: the fleet simulator (``serve_apps/fleet/``): one fleet, the comparison report,
the validation against a real endpoint, and the H100 profile derived from the paper."""

from __future__ import annotations

import argparse
import json

DESCRIPTION = (
    "Replay a request trace (the Mooncake format, or a synthetic workload) through simulated vLLM replicas "
    "modelled from a profile (`swiftkv calibrate` output, or serve_apps/fleet/profiles/), autoscaled and routed "
    "by the real code: our prefill policy and router from serve_apps/, or Serve's request-count policy and "
    "power-of-two router, driven through Ray Serve's own classes on a simulated clock."
)


def _config_options(parser: argparse.ArgumentParser, config_help: str, example: str) -> None:
    parser.add_argument("--config", required=True, help=config_help)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config key, dotted (e.g. {example}); repeatable")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("fleet", help="simulate a fleet of replicas on a request trace (autoscaler + router)",
                              description=DESCRIPTION)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text in (
        ("simulate", "one fleet on some traffic: figures and a replicas/TTFT timeline (a SimulateConfig YAML)"),
        ("report", "every variant x fleet x router on the same traffic, the table, the targets, the plot "
                   "(a ReportConfig YAML, e.g. serve_apps/fleet/configs/report-h100.yaml)"),
        ("validate", "the simulator against a real `swiftkv serve` endpoint on the same trace slice "
                     "(a ValidateConfig YAML, e.g. serve_apps/fleet/configs/validate-cpu.yaml)"),
    ):
        sub = actions.add_parser(name, help=help_text, description=help_text)
        _config_options(sub, "the YAML config", "traffic.copies=8")
        sub.set_defaults(func=run)
    serve_cal = actions.add_parser(
        "calibrate-serve", help="measure a variant's prefill/decode curves through the validation's own endpoint",
        description="Start the `swiftkv serve` endpoint of a ValidateConfig (same deployment, router and replicas), "
        "send prompts of fixed shapes through it (each batch spread over every replica; what is measured: the "
        "config's `calibration` section) and write a one-variant profile: prefill tokens/s by length and decode "
        "step time by batch and context as the replicas run behind Serve, whose proxy, ingress and streaming "
        "share their CPUs on a small host. Engine limits and start-up time are kept from the config's engine "
        "profile (`swiftkv calibrate`).")
    _config_options(serve_cal, "the ValidateConfig YAML whose endpoint is measured", "calibration.batches=[1,4,8]")
    serve_cal.add_argument("--out", required=True, help="profile to write (JSON)")
    serve_cal.set_defaults(func=run)
    resim = actions.add_parser(
        "resimulate", help="compare a saved validation's measurements with this code's simulator",
        description="Read a `swiftkv fleet validate` output folder (validation.json, profile.json), simulate "
        "its slice again with the profile, front end and shared-host slowdown it measured, and print the "
        "comparison with its measured passes: a change to the simulator checked against real measurements "
        "in seconds, without replaying.")
    resim.add_argument("--from", dest="folder", required=True, help="the validation's output folder (or URI)")
    resim.add_argument("--out", help="also write the comparison as resimulation.json in this folder (or URI)")
    resim.set_defaults(func=run)
    derive = actions.add_parser("derive-h100", help="derive the H100 profile from the paper's figures",
                                description="Write the Llama-3.1-8B on one H100 profile derived (not measured) "
                                "from the SwiftKV paper's figures (serve_apps/fleet/paper_profile.py) and print "
                                "every paper figure beside what it gives for it: the four it was fitted to and "
                                "the rest, each with its error (past 15% flagged). Takes about 20 s.")
    derive.add_argument("--out", default="serve_apps/fleet/profiles/h100-llama-3.1-8b.json", help="profile to write")
    derive.add_argument("--hbm-efficiency", type=float, default=0.8,
                        help="share of the H100's 3.35 TB/s a decode step reads at (an assumption; default 0.8)")
    derive.set_defaults(func=run)


def loopback_ray() -> None:
    """The endpoint's local Ray is on 127.0.0.1 (``swiftkv serve`` turns multi-node clusters off); this
    process's own Ray (the engine calibration, the driver that watches the replicas) must too, before
    Ray is first imported, or it resolves 127.0.0.1 to the host's address and cannot reach it."""
    import os
    import sys

    from serve_apps.local import LOOPBACK_RAY

    if "ray" in sys.modules:
        raise RuntimeError("Ray was imported before its loopback setting was made")
    os.environ.update(LOOPBACK_RAY)


def run(args: argparse.Namespace) -> int:
    from serve_apps.fleet.profile import load_profile, save_profile
    from swiftkv.yaml_config import load_config

    if args.action == "derive-h100":
        from serve_apps.fleet.paper_profile import checks, derive, format_checks

        if not 0 < args.hbm_efficiency <= 1:
            raise ValueError(f"--hbm-efficiency must lie in (0, 1], not {args.hbm_efficiency}")
        profile = derive(args.hbm_efficiency)
        print(profile.source)
        save_profile(profile, args.out)
        print(format_checks(checks(profile)))
        print(f"wrote {args.out}")
    elif args.action == "calibrate-serve":
        loopback_ray()
        from serve_apps.fleet.serve_profile import calibrate_through_serve
        from serve_apps.fleet.validate import ValidateConfig

        cfg = load_config(ValidateConfig, args.config, args.set, what="fleet validate config")
        if cfg.profile is None:
            raise ValueError("calibrate-serve keeps the engine limits of the validate config's `profile`: set it")
        profile = calibrate_through_serve(cfg, load_profile(cfg.profile))
        save_profile(profile, args.out)
        print(json.dumps(profile.model_dump(mode="json", exclude_defaults=True), indent=1))
        print(f"wrote {args.out}")
    elif args.action == "resimulate":
        from serve_apps.fleet.validate import format_validation, resimulate
        from swiftkv.outputs import write_files

        result = resimulate(args.folder)
        print(format_validation(result))
        if args.out:
            write_files(args.out, {"resimulation.json": json.dumps(result, indent=1).encode()})
            print(f"wrote {args.out}/resimulation.json")
    elif args.action == "simulate":
        from serve_apps.fleet.config import SimulateConfig
        from serve_apps.fleet.run import run_simulate

        cfg = load_config(SimulateConfig, args.config, args.set, what="fleet simulate config")
        print(json.dumps(run_simulate(cfg, load_profile(cfg.profile)), indent=1))
    elif args.action == "report":
        from serve_apps.fleet.report import ReportConfig, format_report, run_report

        cfg = load_config(ReportConfig, args.config, args.set, what="fleet report config")
        results = run_report(cfg, load_profile(cfg.profile))
        print(format_report(cfg, results["runs"], results["targets"]))
        print(f"wrote {cfg.out}/results.json, report.md, timeline.png")
    else:
        loopback_ray()
        from serve_apps.fleet.validate import ValidateConfig, format_validation, run_validate

        cfg = load_config(ValidateConfig, args.config, args.set, what="fleet validate config")
        print(format_validation(run_validate(cfg)))
        print(f"wrote {cfg.out}/validation.json, validation.png, profile.json")
    return 0
