"""The step graph, step.onnx: one decode step of the attention block with its past keys and values.

Inputs x (batch, new, C), past_key and past_value (batch, n_head, past, head_size); outputs y
(batch, new, C), exactly the last `new` rows of model.onnx over the whole sequence, and
present_key/present_value (batch, n_head, past + new, head_size). Built node by node with
onnx.helper: the projections as MatMul + Add, one ONNX `Attention` op (opset 23) that
concatenates the past, and a boolean mask built in the graph from the two lengths, so that new
token i (at position past + i) sees keys 0..past + i: causal, aligned to the end of the keys.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from export.layout import INPUT_NAME, OUTPUT_NAME, PAST_NAMES, PRESENT_NAMES
from model import MHAConfig
from model.checkpoint import Weights

log = logging.getLogger(__name__)

STEP_OPSET = 23
STEP_IR_VERSION = 10  # what ONNX Runtime 1.31 reads


class StepGraphError(RuntimeError):
    """The step graph cannot be built for this model."""


def build_step_graph(config: MHAConfig, weights: Weights) -> onnx.ModelProto:
    if not config.causal:
        raise StepGraphError("incremental decoding needs a causal model")
    C, nh, hs = config.d_model, config.n_head, config.head_size
    initializers: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    for name, source in (("q_proj", INPUT_NAME), ("k_proj", INPUT_NAME), ("v_proj", INPUT_NAME)):
        nodes += _linear(name, source, weights, initializers)
    nodes += _end_aligned_mask(initializers)
    past_key, past_value = PAST_NAMES
    nodes.append(
        helper.make_node(
            "Attention",
            ["q_proj.out", "k_proj.out", "v_proj.out", "mask", past_key, past_value],
            ["heads", *PRESENT_NAMES],
            q_num_heads=nh,
            kv_num_heads=nh,
            scale=1.0 / math.sqrt(hs),
        )
    )  # (batch, new, C): the heads merged
    nodes += _linear("o_proj", "heads", weights, initializers)
    nodes.append(helper.make_node("Identity", ["o_proj.out"], [OUTPUT_NAME]))
    cache: list[str | int | None] = ["batch", nh, "past", hs]
    graph = helper.make_graph(
        nodes,
        "mha_step",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", "new", C])]
        + [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in PAST_NAMES],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", "new", C])]
        + [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", nh, "total", hs]) for n in PRESENT_NAMES],
        initializers,
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", STEP_OPSET)],
        ir_version=STEP_IR_VERSION,
        producer_name="mha-serve",
    )


ELEM_TYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
TORCH_TYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _initializer(tensor: torch.Tensor, name: str, precision: str) -> onnx.TensorProto:
    """A weight as an initializer in `precision` (bf16 through its raw bytes: numpy has no bf16)."""
    t = tensor.detach().to(TORCH_TYPES[precision]).contiguous()
    if precision != "bf16":
        return numpy_helper.from_array(t.numpy(), name)
    raw = t.view(torch.int16).numpy().tobytes()
    return helper.make_tensor(name, TensorProto.BFLOAT16, list(t.shape), raw, raw=True)


def _linear(
    name: str, source: str, weights: Weights, initializers: list[onnx.TensorProto], precision: str = "fp32"
) -> list[onnx.NodeProto]:
    """nn.Linear as MatMul by the transposed weight (C, C), then Add of the bias when there is one."""
    weight = weights[f"{name}.weight"].float().T  # (C_in, C_out)
    initializers.append(_initializer(weight, f"{name}.weight_t", precision))
    bias = weights.get(f"{name}.bias")
    if bias is None:
        return [helper.make_node("MatMul", [source, f"{name}.weight_t"], [f"{name}.out"])]
    initializers.append(_initializer(bias.float(), f"{name}.bias", precision))
    return [
        helper.make_node("MatMul", [source, f"{name}.weight_t"], [f"{name}.matmul"]),
        helper.make_node("Add", [f"{name}.matmul", f"{name}.bias"], [f"{name}.out"]),
    ]


def _end_aligned_mask(initializers: list[onnx.TensorProto]) -> list[onnx.NodeProto]:
    """mask (new, past + new), bool: key j is visible to new token i iff j <= past + i."""
    for name, value in (("axis0", [0]), ("axis1", [1]), ("axis2", [2]), ("zero", 0), ("one", 1)):
        initializers.append(numpy_helper.from_array(np.array(value, np.int64), name))
    node = helper.make_node
    return [
        node("Shape", [PAST_NAMES[0]], ["past_shape"]),
        node("Gather", ["past_shape", "axis2"], ["past_1"]),  # (1,)
        node("Shape", [INPUT_NAME], ["x_shape"]),
        node("Gather", ["x_shape", "axis1"], ["new_1"]),  # (1,)
        node("Squeeze", ["past_1"], ["past"]),
        node("Squeeze", ["new_1"], ["new"]),
        node("Add", ["past", "new"], ["total"]),
        node("Range", ["past", "total", "one"], ["query_positions"]),  # (new,)
        node("Range", ["zero", "total", "one"], ["key_positions"]),  # (total,)
        node("Unsqueeze", ["query_positions", "axis1"], ["query_column"]),  # (new, 1)
        node("Unsqueeze", ["key_positions", "axis0"], ["key_row"]),  # (1, total)
        node("LessOrEqual", ["key_row", "query_column"], ["mask"]),  # (new, total)
    ]


def export_step_graph(config: MHAConfig, weights: Weights, path: Path) -> None:
    model = build_step_graph(config, weights)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    log.info("wrote %s (%.1f KiB)", path.name, path.stat().st_size / 1024)


def build_precision_graph(config: MHAConfig, weights: Weights, precision: str) -> onnx.ModelProto:
    """The whole-sequence graph computed in `precision` (fp16 or bf16) with float32 x and y: a
    Cast in, the weights stored in `precision`, one Attention op, a Cast out."""
    if precision not in ("fp16", "bf16"):
        raise StepGraphError(f"precision {precision!r}: expected fp16 or bf16 (fp32 is model.onnx)")
    C, nh, hs = config.d_model, config.n_head, config.head_size
    initializers: list[onnx.TensorProto] = []
    nodes = [helper.make_node("Cast", [INPUT_NAME], ["x_half"], to=ELEM_TYPES[precision])]
    for name in ("q_proj", "k_proj", "v_proj"):
        nodes += _linear(name, "x_half", weights, initializers, precision)
    nodes.append(
        helper.make_node(
            "Attention",
            ["q_proj.out", "k_proj.out", "v_proj.out"],
            ["heads"],
            q_num_heads=nh,
            kv_num_heads=nh,
            is_causal=int(config.causal),
            scale=1.0 / math.sqrt(hs),
        )
    )  # (batch, seq, C)
    nodes += _linear("o_proj", "heads", weights, initializers, precision)
    nodes.append(helper.make_node("Cast", ["o_proj.out"], [OUTPUT_NAME], to=TensorProto.FLOAT))
    shape: list[str | int | None] = ["batch", "seq", C]
    graph = helper.make_graph(
        nodes,
        f"mha_{precision}",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, shape)],
        initializers,
    )
    opsets = [helper.make_opsetid("", STEP_OPSET)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=STEP_IR_VERSION, producer_name="mha-serve")
