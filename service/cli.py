"""`mha`: export, verify, serve, infer, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model import MHAConfig
    from model.checkpoint import Weights

log = logging.getLogger("mha")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from model import MHAConfig

    d = MHAConfig()
    p.add_argument("--d-model", type=int, default=None, help=f"C, the model width (default {d.d_model})")
    p.add_argument("--n-head", type=int, default=None, help=f"number of heads (default {d.n_head})")
    p.add_argument("--max-seq-len", type=int, default=None, help=f"longest T served (default {d.max_seq_len})")
    p.add_argument("--no-causal", action="store_true", help="unmasked (bidirectional) attention")
    p.add_argument("--no-bias", action="store_true", help="projections without bias")
    p.add_argument("--seed", type=int, default=0, help="seed for the default weights (default 0)")


def cmd_export(args: argparse.Namespace) -> int:
    from export.onnx_export import DEFAULT_OPSET
    from export.pipeline import ParityError, export_model_dir
    from model.checkpoint import CheckpointError

    try:
        config, weights = _model_from_args(args)
    except (CheckpointError, ValueError) as exc:
        log.error("cannot build the model: %s", exc)
        return 2
    try:
        report = export_model_dir(Path(args.out), config, weights, opset=args.opset or DEFAULT_OPSET, graph=args.graph)
    except ParityError as exc:
        sys.stdout.write(exc.report.table() + "\n")
        log.error("refusing to write %s: the exported model fails parity", args.out)
        return 1
    sys.stdout.write(report.table() + "\n")
    return 0


def _model_from_args(args: argparse.Namespace) -> tuple[MHAConfig, Weights]:
    from dataclasses import replace

    from model import MHAConfig
    from model.checkpoint import init_weights, load_any

    if args.checkpoint:
        config, weights = load_any(
            args.checkpoint, n_head=args.n_head, max_seq_len=args.max_seq_len, prefix=args.import_prefix
        )
        if args.no_causal:
            config = replace(config, causal=False)
        return config, weights
    defaults = MHAConfig()
    config = MHAConfig(
        d_model=args.d_model or defaults.d_model,
        n_head=args.n_head or defaults.n_head,
        max_seq_len=args.max_seq_len or defaults.max_seq_len,
        causal=not args.no_causal,
        bias=not args.no_bias,
    )
    return config, init_weights(config, seed=args.seed)


def cmd_verify(args: argparse.Namespace) -> int:
    from export.verify import verify_model_dir

    if args.url:
        from service.client import verify_server

        report = verify_server(args.url, Path(args.model_dir), **_client_security(args))
    else:
        report = verify_model_dir(Path(args.model_dir))
    sys.stdout.write(report.table() + "\n")
    return 0 if report.ok else 1


def _client_security(args: argparse.Namespace) -> dict[str, object]:
    return {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mha", description="Serve a causal multi-head attention block over gRPC.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export the model to a verified ONNX model directory")
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument("--checkpoint", help="our safetensors, GPT-2 safetensors (c_attn) or nanoGPT .pt")
    p.add_argument("--import-prefix", help="with several layers in --checkpoint: which, e.g. 'h.0.attn.'")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default 23)")
    p.add_argument(
        "--graph",
        choices=("attention", "plain"),
        default="attention",
        help="attention: one ONNX Attention op (default, fastest on ORT); plain: MatMul/Softmax",
    )
    _add_model_args(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("verify", help="parity of a model directory (or of a running server with --url)")
    p.add_argument("model_dir", help="model directory written by `mha export`")
    p.add_argument("--url", help="HOST:PORT of a running server to check end to end")
    p.set_defaults(func=cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
