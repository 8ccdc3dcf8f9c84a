"""model.onnx as ONNX Runtime's CPU provider serves it: the same arithmetic in fewer nodes.

A small request costs a few microseconds per node, whatever the node computes ((1, 64, 128) on
one thread: 160 us for model.onnx's 21 nodes, 134 us for the 6 left here; docs/operations.md).
Two rewrites of what onnx_export writes, both exact:

- the three projections of x (MatMul, and Add of the bias) as one MatMul against [Wq Wk Wv], one
  Add and a Split: each output column is the same dot product as before;
- the heads split before Attention (Reshape to (B, T, nh, hs), Transpose) and merged after it
  (Transpose, Reshape to (B, T, C)) left to the op, which takes (B, T, C) given its head counts.

A graph without these shapes is served as it is. Either way the backend that serves it is checked
against the float64 reference before any request (service/backends/selection.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

HEADS_PERM = [0, 2, 1, 3]  # (B, T, nh, hs) <-> (B, nh, T, hs)


@dataclass
class _Graph:
    """Lookups over a graph being rewritten."""

    graph: onnx.GraphProto

    def producer(self, name: str) -> onnx.NodeProto | None:
        return next((n for n in self.graph.node if name in n.output), None)

    def consumers(self, name: str) -> list[onnx.NodeProto]:
        return [n for n in self.graph.node if name in n.input]

    def constant(self, name: str) -> np.ndarray | None:
        found = next((t for t in self.graph.initializer if t.name == name), None)
        return numpy_helper.to_array(found) if found is not None else None

    def only_consumer(self, name: str, op_type: str) -> onnx.NodeProto | None:
        users = self.consumers(name)
        if len(users) != 1 or users[0].op_type != op_type or name in {o.name for o in self.graph.output}:
            return None
        return users[0]


def serving_graph(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of `model` with the rewrites that apply to it, and their names."""
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    done = [name for name, rewrite in REWRITES if rewrite(_Graph(rewritten.graph))]
    if done:
        _drop_dead(rewritten.graph)
        onnx.checker.check_model(rewritten)
    return rewritten, done


# The projections ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Projection:
    matmul: onnx.NodeProto
    add: onnx.NodeProto | None
    weight: np.ndarray  # (C, C_out)
    bias: np.ndarray | None  # (C_out,)

    @property
    def output(self) -> str:
        return (self.add or self.matmul).output[0]


def _projection(g: _Graph, matmul: onnx.NodeProto) -> _Projection | None:
    weight = g.constant(matmul.input[1])
    if weight is None or weight.ndim != 2:
        return None
    add = g.only_consumer(matmul.output[0], "Add")
    if add is None:
        return _Projection(matmul, None, weight, None)
    other = add.input[1] if add.input[0] == matmul.output[0] else add.input[0]
    bias = g.constant(other)
    if bias is None or bias.shape != (weight.shape[1],):
        return _Projection(matmul, None, weight, None)
    return _Projection(matmul, add, weight, bias)


def fuse_projections(g: _Graph) -> bool:
    """Three MatMul (+ Add) of the graph's input with constant weights -> MatMul, Add, Split."""
    x = g.graph.input[0].name
    matmuls = [n for n in g.graph.node if n.op_type == "MatMul" and n.input[0] == x]
    projections = [p for n in matmuls if (p := _projection(g, n)) is not None]
    if len(matmuls) != 3 or len(projections) != 3 or len({p.bias is None for p in projections}) != 1:
        return False
    weight = np.concatenate([p.weight for p in projections], axis=1)  # (C, sum C_out)
    widths = np.array([p.weight.shape[1] for p in projections], dtype=np.int64)
    names = ("serving.qkv_weight", "serving.qkv_bias", "serving.qkv_widths")
    tensors = [numpy_helper.from_array(weight, names[0]), numpy_helper.from_array(widths, names[2])]
    fused = [helper.make_node("MatMul", [x, names[0]], ["serving.qkv"], name="serving_qkv")]  # (B, T, 3C)
    biases = [p.bias for p in projections if p.bias is not None]
    if biases:
        tensors.append(numpy_helper.from_array(np.concatenate(biases), names[1]))  # (3C,)
        fused.append(helper.make_node("Add", ["serving.qkv", names[1]], ["serving.qkv_b"], name="serving_qkv_bias"))
    outputs = [p.output for p in projections]
    fused.append(helper.make_node("Split", [fused[-1].output[0], names[2]], outputs, name="serving_split", axis=-1))
    old = [n for p in projections for n in (p.matmul, p.add) if n is not None]
    _replace(g.graph, old, fused)
    g.graph.initializer.extend(tensors)
    return True


# The heads ---------------------------------------------------------------------------------


def _split_heads(g: _Graph, name: str) -> tuple[str, tuple[int, int]] | None:
    """`name` = Transpose(Reshape(t, [B, T, nh, hs])): (t, (nh, hs)), else None."""
    transpose = g.producer(name)
    if transpose is None or transpose.op_type != "Transpose" or _perm(transpose) != HEADS_PERM:
        return None
    reshape = g.producer(transpose.input[0])
    if reshape is None or reshape.op_type != "Reshape":
        return None
    heads = _heads_of_shape(g, reshape.input[1])
    return (reshape.input[0], heads) if heads is not None else None


def _heads_of_shape(g: _Graph, shape: str) -> tuple[int, int] | None:
    """(nh, hs) of a 4-d shape [B, T, nh, hs]: a Concat whose last two parts are constants."""
    parts = _constant_tail(g, shape, 4, 2)
    return (parts[0], parts[1]) if parts is not None else None


def _constant_tail(g: _Graph, shape: str, rank: int, count: int) -> list[int] | None:
    """The last `count` entries of a shape built by a Concat of `rank` parts, when constants."""
    concat = g.producer(shape)
    if concat is None or concat.op_type != "Concat" or len(concat.input) != rank:
        return None
    values = [g.constant(name) for name in concat.input[rank - count :]]
    if any(v is None or v.size != 1 for v in values):
        return None
    return [int(v.reshape(-1)[0]) for v in values if v is not None]


def _merged_heads(g: _Graph, name: str, width: int) -> list[onnx.NodeProto] | None:
    """[Transpose, Reshape] that merge the heads of `name` into (B, T, width), else None."""
    transpose = g.only_consumer(name, "Transpose")
    if transpose is None or _perm(transpose) != HEADS_PERM:
        return None
    reshape = g.only_consumer(transpose.output[0], "Reshape")
    if reshape is None or _constant_tail(g, reshape.input[1], 3, 1) != [width]:
        return None
    return [transpose, reshape]


def attend_on_3d(g: _Graph) -> bool:
    """Attention(split heads of q, k, v) merged back -> Attention of (B, T, C) with its head counts."""
    changed = False
    standard = [n for n in g.graph.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]  # not contrib ops
    for node in [n for n in standard if len(n.input) == 3]:
        if any(a.name in ("q_num_heads", "kv_num_heads") for a in node.attribute):
            continue
        split = [found for name in node.input if (found := _split_heads(g, name)) is not None]  # [(t, (nh, hs))]
        if len(split) != 3 or len({heads for _, heads in split}) != 1:
            continue
        heads, size = split[0][1]
        merged = _merged_heads(g, node.output[0], heads * size)
        if merged is None:
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        inputs = [t for t, _ in split]  # q, k, v as (B, T, C)
        output = merged[1].output[0]  # (B, T, C)
        attend = helper.make_node(
            "Attention", inputs, [output], name="serving_attention", q_num_heads=heads, kv_num_heads=heads, **attributes
        )
        _replace(g.graph, [node, *merged], [attend])
        changed = True
    return changed


REWRITES = (("fuse_projections", fuse_projections), ("attend_on_3d", attend_on_3d))


# Graph surgery -----------------------------------------------------------------------------


def _perm(node: onnx.NodeProto) -> list[int]:
    return next((list(helper.get_attribute_value(a)) for a in node.attribute if a.name == "perm"), [])


def _replace(graph: onnx.GraphProto, old: Iterable[onnx.NodeProto], new: list[onnx.NodeProto]) -> None:
    """`new` in place of `old`, where the first of them was (before every consumer of theirs)."""
    gone = {tuple(n.output) for n in old}  # a node is known by its outputs
    nodes = list(graph.node)
    at = min(i for i, n in enumerate(nodes) if tuple(n.output) in gone)
    kept = [n for n in nodes if tuple(n.output) not in gone]
    graph.ClearField("node")
    graph.node.extend(kept[:at] + new + kept[at:])


def _drop_dead(graph: onnx.GraphProto) -> None:
    """Nodes whose outputs nobody reads, then initializers nobody reads."""
    wanted = {o.name for o in graph.output}
    while True:
        read = wanted | {i for n in graph.node for i in n.input}
        dead = [n for n in graph.node if not any(o in read for o in n.output)]
        if not dead:
            break
        _replace(graph, dead, [])
    read = {i for n in graph.node for i in n.input}
    kept = [t for t in graph.initializer if t.name in read]
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
