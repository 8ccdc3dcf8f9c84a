"""The step graphs: one decode step of the attention block, with the sequence's cache read
where it lies.

Two graphs, so that no step copies the past keys and values:
- step_project.onnx: x (rows, new, C) -> query, key, value, each (rows, nh, new, hs). The new
  tokens of several sequences go through it in one run (their rows merged).
- step_attend.onnx: a sequence's query, its key and value caches (rows, nh, capacity, hs), into
  which the caller has written the new keys and values at [past, past + new), and past_length
  -> y (rows, new, C), exactly the last `new` rows of model.onnx over the whole sequence. One
  ONNX `Attention` op (opset 23) attends over the whole cache with a boolean mask built in the
  graph: new token i (at position past + i) sees keys 0..past + i, so the positions beyond
  (zeros, or a failed step's leftovers) are never seen, and the cache is passed as it lies.
Built node by node with onnx.helper: the projections as MatMul + Add.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from export.layout import CACHE_NAMES, INPUT_NAME, OUTPUT_NAME, PAST_LENGTH_NAME, PROJECTED_NAMES
from model import MHAConfig
from model.checkpoint import Weights

log = logging.getLogger(__name__)

STEP_OPSET = 23
STEP_IR_VERSION = 10  # what ONNX Runtime 1.31 reads


class StepGraphError(RuntimeError):
    """The step graphs cannot be built for this model."""


def build_step_graphs(config: MHAConfig, weights: Weights) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(step_project, step_attend) for a causal model."""
    if not config.causal:
        raise StepGraphError("incremental decoding needs a causal model")
    return _project_graph(config, weights), _attend_graph(config, weights)


def _project_graph(config: MHAConfig, weights: Weights) -> onnx.ModelProto:
    nh, hs = config.n_head, config.head_size
    initializers = [numpy_helper.from_array(np.array([0, 0, nh, hs], np.int64), "heads_shape")]
    nodes: list[onnx.NodeProto] = []
    for name, out in zip(("q_proj", "k_proj", "v_proj"), PROJECTED_NAMES, strict=True):
        nodes += _linear(name, INPUT_NAME, weights, initializers)  # (rows, new, C)
        nodes.append(
            helper.make_node("Reshape", [f"{name}.out", "heads_shape"], [f"{name}.heads"])
        )  # (rows, new, nh, hs)
        nodes.append(helper.make_node("Transpose", [f"{name}.heads"], [out], perm=[0, 2, 1, 3]))  # (rows, nh, new, hs)
    heads: list[str | int | None] = ["rows", nh, "new", hs]
    return _model(
        nodes,
        "mha_step_project",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["rows", "new", config.d_model])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, heads) for n in PROJECTED_NAMES],
        initializers,
    )


def _attend_graph(config: MHAConfig, weights: Weights) -> onnx.ModelProto:
    C, nh, hs = config.d_model, config.n_head, config.head_size
    initializers = [numpy_helper.from_array(np.array([0, 0, C], np.int64), "merged_shape")]
    nodes = _end_aligned_mask(initializers)
    query = PROJECTED_NAMES[0]
    nodes.append(
        helper.make_node("Attention", [query, *CACHE_NAMES, "mask"], ["heads"], scale=1.0 / math.sqrt(hs))
    )  # (rows, nh, new, hs)
    nodes.append(helper.make_node("Transpose", ["heads"], ["heads_t"], perm=[0, 2, 1, 3]))  # (rows, new, nh, hs)
    nodes.append(helper.make_node("Reshape", ["heads_t", "merged_shape"], ["merged"]))  # (rows, new, C)
    nodes += _linear("o_proj", "merged", weights, initializers)
    nodes.append(helper.make_node("Identity", ["o_proj.out"], [OUTPUT_NAME]))
    cache: list[str | int | None] = ["rows", nh, "capacity", hs]
    return _model(
        nodes,
        "mha_step_attend",
        [helper.make_tensor_value_info(query, TensorProto.FLOAT, ["rows", nh, "new", hs])]
        + [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in CACHE_NAMES]
        + [helper.make_tensor_value_info(PAST_LENGTH_NAME, TensorProto.INT64, [])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["rows", "new", C])],
        initializers,
    )


def _model(
    nodes: list[onnx.NodeProto],
    name: str,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto],
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", STEP_OPSET)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=STEP_IR_VERSION, producer_name="mha-serve")


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
    """mask (new, capacity), bool: key j is visible to new token i iff j <= past + i."""
    for name, value in (("axis0", [0]), ("axis1", [1]), ("axis2", [2]), ("zero", 0), ("one", 1)):
        initializers.append(numpy_helper.from_array(np.array(value, np.int64), name))
    node = helper.make_node
    return [
        node("Shape", [CACHE_NAMES[0]], ["cache_shape"]),
        node("Gather", ["cache_shape", "axis2"], ["capacity_1"]),  # (1,)
        node("Shape", [PROJECTED_NAMES[0]], ["query_shape"]),
        node("Gather", ["query_shape", "axis2"], ["new_1"]),  # (1,)
        node("Squeeze", ["capacity_1"], ["capacity"]),
        node("Squeeze", ["new_1"], ["new"]),
        node("Add", [PAST_LENGTH_NAME, "new"], ["total"]),
        node("Range", [PAST_LENGTH_NAME, "total", "one"], ["query_positions"]),  # (new,)
        node("Range", ["zero", "capacity", "one"], ["key_positions"]),  # (capacity,)
        node("Unsqueeze", ["query_positions", "axis1"], ["query_column"]),  # (new, 1)
        node("Unsqueeze", ["key_positions", "axis0"], ["key_row"]),  # (1, capacity)
        node("LessOrEqual", ["key_row", "query_column"], ["mask"]),  # (new, capacity)
    ]


def export_step_graphs(config: MHAConfig, weights: Weights, paths: tuple[Path, Path]) -> None:
    for model, path in zip(build_step_graphs(config, weights), paths, strict=True):
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
    return _model(
        nodes,
        f"mha_{precision}",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, shape)],
        initializers,
    )
