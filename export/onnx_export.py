"""Torch -> ONNX with symbolic batch and sequence dimensions."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx
import torch
from torch.export import Dim

from export.layout import INPUT_NAME, OUTPUT_NAME
from model import MHAConfig, MultiHeadAttention
from model.checkpoint import Weights

log = logging.getLogger(__name__)

DEFAULT_OPSET = 23
# "attention": SDPA exported as one ONNX Attention op (is_causal=1), the mask never materialised
#   in the file. "plain": MatMul/Softmax with the causal mask built from T by Trilu.
GRAPHS = ("attention", "plain")


class ExportError(RuntimeError):
    """The exported graph is not what the model directory promises."""


def export_onnx(
    config: MHAConfig, weights: Weights, path: Path, opset: int = DEFAULT_OPSET, graph: str = "attention"
) -> None:
    if graph not in GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS}, got {graph!r}")
    module = MultiHeadAttention.from_weights(config, weights, fast=graph == "attention")
    # B, T >= 2 in the example: a size-1 example dimension is specialised to a constant.
    example = torch.zeros(2, min(3, max(2, config.max_seq_len)), config.d_model)
    dynamic = {INPUT_NAME: {0: Dim("batch"), 1: Dim("seq")}}
    log.info("tracing %s graph with torch.onnx.export (dynamo, opset %d)", graph, opset)
    # "torchvision is not installed. Skipping torchvision::nms", and such, at every export; set here,
    # not at start: importing torch resets the levels of its loggers
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():  # the exporter's own deprecation chatter, not ours to act on
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.onnx.export(
            module,
            (example,),
            dynamo=True,
            opset_version=opset,
            dynamic_shapes=dynamic,
            external_data=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            verbose=False,
        )
    if program is None:
        raise ExportError("torch.onnx.export returned no program")
    program.save(str(path), external_data=False)
    check_opset(path, opset)
    check_graph(path, config)


def check_opset(path: Path, opset: int) -> None:
    """The file's ONNX opset is the one asked for, which manifest.json records: where the exporter
    cannot write it (opset 1, or one past what its converter reaches) it writes another."""
    imports = onnx.load(str(path), load_external_data=False).opset_import
    written = {o.version for o in imports if o.domain in ("", "ai.onnx")}
    if written != {opset}:
        raise ExportError(
            f"opset {opset} was asked for and the exporter wrote {sorted(written)}: choose an opset it can write, "
            f"such as the default {DEFAULT_OPSET}"
        )


def check_graph(path: Path, config: MHAConfig) -> onnx.ModelProto:
    """onnx.checker, shape inference, and the interface: x/y float32 [batch, seq, C] symbolic."""
    log.info("checking %s with onnx.checker and shape inference", path.name)
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True)
    for values, name in ((model.graph.input, INPUT_NAME), (model.graph.output, OUTPUT_NAME)):
        if [v.name for v in values] != [name]:
            raise ExportError(
                f"graph {name!r}: expected exactly one tensor named {name!r}, got {[v.name for v in values]}"
            )
        tensor_type = values[0].type.tensor_type
        if tensor_type.elem_type != onnx.TensorProto.FLOAT:
            raise ExportError(f"{name!r} has elem_type {tensor_type.elem_type}; expected FLOAT")
        dims = tensor_type.shape.dim
        if len(dims) != 3 or not dims[0].dim_param or not dims[1].dim_param:
            raise ExportError(f"{name!r} dims {dims}: expected symbolic batch and seq")
        if dims[2].dim_value != config.d_model:
            raise ExportError(f"{name!r} last dim {dims[2].dim_value}; expected C={config.d_model}")
    return model
