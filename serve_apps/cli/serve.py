"""``swiftkv serve``: the Ray Serve application on an embedded local Ray (``serve_apps/local.py``)."""

from __future__ import annotations

import argparse

from swiftkv.model_source import MODEL_HELP


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve models behind an OpenAI-compatible endpoint (Ray Serve + vLLM, local Ray)",
        description="Start a local Ray, deploy the swiftkv Serve application (an OpenAI-compatible ingress "
        "routing by the request's model field to vLLM replicas, autoscaled and routed on prefill load) and "
        "print its URL when ready. SIGTERM or Ctrl-C drains in-flight requests, stops Serve and Ray and "
        "leaves no process behind. On a cluster, use `serve deploy` with the same config file instead.",
    )
    p.add_argument("--model", action="append", default=[], metavar="[NAME=]MODEL",
                   help=f"a model to serve, repeatable ({MODEL_HELP}); NAME is what requests put in "
                   "'model' (default: the folder name). Replaces the config file's models, each taking the "
                   "file's first model entry as its settings")
    p.add_argument("--config", help="a Serve config file from serve_apps/ (or the bare application args)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, dotted (e.g. models.0.autoscaling.max_replicas=2); repeatable")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP endpoint binds (default: loopback only); "
                   "any other needs an API key (SWIFTKV_API_KEY) or --insecure-no-auth")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve clients on other hosts without an API key (the config's insecure_no_auth)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=8080,
                   help="port of Ray's Prometheus metrics endpoint (on 127.0.0.1, as all of the local Ray)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="logical CPUs of the local Ray (default: max(8, cores); each replica reserves its num_cpus)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from serve_apps.local import read_app_config, serve_locally

    config = read_app_config(args.config, args.model, args.set + ["insecure_no_auth=true"] * args.insecure_no_auth)
    return serve_locally(config, args.host, args.port, args.num_cpus, args.metrics_port)
