"""ONNX Runtime backends: CUDA (confirmed, TF32 off; decode caches bound in place) and CPU (bounded memory)."""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from export.layout import CACHE_NAMES, INPUT_NAME, OUTPUT_NAME, PAST_LENGTH_NAME, PROJECTED_NAMES
from service.backends.base import Backend, BackendLoadError, Step
from service.backends.crossover import measure_crossover
from service.batching import merge

log = logging.getLogger(__name__)


def _load_session(
    model_path: Path, options: ort.SessionOptions, providers: list[str | tuple[str, dict[str, object]]]
) -> ort.InferenceSession:
    """A session of the graph in `model_path`, as the file holds it (manifest.json vouches for it;
    `mha export` applied the serving rewrites before it was verified)."""
    if not model_path.is_file():
        raise BackendLoadError(f"{model_path} does not exist")
    try:
        return ort.InferenceSession(str(model_path), options, providers=providers)
    except Exception as exc:  # ORT raises its own exception types for bad graphs and providers
        raise BackendLoadError(f"ONNX Runtime could not load {model_path.name}: {exc}") from exc


def _cpu_options(threads: int, spinning: bool) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Idle pool threads busy-wait by default: lower latency for back-to-back runs, but a core
    # burnt per thread between requests (bench/cpu_per_request.py measures both).
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "1" if spinning else "0")
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.enable_mem_pattern = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


SHRINK_CELLS = 1 << 22  # rows x T x T from which a run hands its arena memory back afterwards


class OrtCpuBackend(Backend):
    """ORT's CPU provider without the memory pattern, which plans buffers per input shape.

    Chosen by bench/ort_memory.py, which compares resident memory and time of the session
    variants side by side (results in bench/results/ort_memory.json). After a large batch the
    arena shrinks back (bench/soak.py measures the residue), so one large request does not
    leave gigabytes resident.
    """

    name = "ort-cpu"
    device = "cpu"
    platform = "onnxruntime_onnx"

    def __init__(
        self,
        model_path: Path,
        threads: int,
        spinning: bool = False,
        width: int | None = None,
        step_paths: tuple[Path, Path] | None = None,
        single_max_tokens: int | None = None,
    ) -> None:
        """`single_max_tokens`: the crossover another start measured (None: measure it here)."""
        self._session = _load_session(model_path, _cpu_options(threads, spinning), ["CPUExecutionProvider"])
        self._input = self._session.get_inputs()[0].name
        self._outputs = [self._session.get_outputs()[0].name]  # named: ORT lists them on every run otherwise
        self._shrink = ort.RunOptions()
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        # Small batches run on a second, single-threaded session when that measures faster (waking
        # the pool can cost more than it saves on a few tokens): the crossover is measured here,
        # per model and machine.
        self._single: ort.InferenceSession | None = None
        self.single_max_tokens = 0  # rows x T up to which the single-threaded session runs
        if threads > 1 and width is not None:
            self._single = _load_session(model_path, _cpu_options(1, spinning), ["CPUExecutionProvider"])
            self.single_max_tokens = self._crossover(width) if single_max_tokens is None else single_max_tokens
            log.debug(
                "ORT-CPU: measured at start, batches of up to %d tokens run faster on one thread (varies with load)",
                self.single_max_tokens,
            )
        # Decode steps on the step graphs: single-threaded sessions for steps of few tokens (the
        # same crossover as above), the pool's for the others.
        self._step_pool = self._step_one = None
        if step_paths is not None:
            self._step_pool = CpuSteps(step_paths, _cpu_options(threads, spinning))
            self._step_one = CpuSteps(step_paths, _cpu_options(1, spinning)) if threads > 1 else self._step_pool

    @property
    def steps(self) -> bool:
        return self._step_pool is not None

    def step(self, steps: Sequence[Step]) -> list[np.ndarray]:
        if self._step_pool is None or self._step_one is None:
            return super().step(steps)
        tokens = sum(int(s.x.shape[0]) * int(s.x.shape[1]) for s in steps)
        return (self._step_one if tokens <= self.single_max_tokens else self._step_pool).run(steps)

    def run(self, x: np.ndarray) -> np.ndarray:
        tokens = int(x.shape[0]) * int(x.shape[1])
        if self._single is not None and tokens <= self.single_max_tokens:
            return self._single.run(self._outputs, {self._input: x})[0]
        return self._session.run(self._outputs, {self._input: x}, self.run_options(x))[0]

    def run_options(self, x: np.ndarray) -> ort.RunOptions | None:
        """A pool's run of (B, T, C): a large one hands its arena memory back afterwards."""
        rows, seq = x.shape[:2]  # numpy's shapes are Python ints
        return self._shrink if rows * seq * seq >= SHRINK_CELLS else None

    def _crossover(self, width: int) -> int:
        """The largest T of (1, T, C), among powers of 4, up to which one thread is chosen."""
        assert self._single is not None
        one, pool = self._single, self._session
        return measure_crossover(
            lambda x: one.run(None, {self._input: x}), lambda x: pool.run(None, {self._input: x}), width
        )


def _cuda_steps(
    paths: tuple[Path, Path], options: ort.SessionOptions, cuda: list[str | tuple[str, dict[str, object]]], device: int
) -> CudaSteps | None:
    """The step graphs' sessions on the GPU, when ORT places every compute-heavy node of them there."""
    for path in paths:
        if stray := off_device(node_placements(path, cuda), "CUDAExecutionProvider"):
            log.warning(
                "ORT-CUDA computes no decode steps: it placed %s of %s off the GPU", ", ".join(stray), path.name
            )
            return None
    project, attend = (_load_session(path, options, cuda) for path in paths)
    return CudaSteps(project, attend, device)


class CpuSteps:
    """Decode steps on the step graphs, the caches in host memory: the new tokens of every
    sequence projected in one run, then each sequence's attention over its cache as it lies
    (B, nh, capacity, hs), its new keys and values written in first: nothing old is copied."""

    def __init__(self, paths: tuple[Path, Path], options: ort.SessionOptions) -> None:
        self.project, self.attend = (_load_session(path, options, ["CPUExecutionProvider"]) for path in paths)

    def run(self, steps: Sequence[Step]) -> list[np.ndarray]:
        merged = merge([s.x for s in steps])  # (R, t_max, C), right-padded: rows are projected alone
        q, k, v = self.project.run(list(PROJECTED_NAMES), {INPUT_NAME: merged})  # (R, nh, t_max, hs) each
        out, row = [], 0
        for step in steps:
            (B, t), P = step.x.shape[:2], step.cache.length
            rows = slice(row, row + B)
            keys, values = step.cache.keys.numpy(), step.cache.values.numpy()  # (B, nh, capacity, hs), views
            keys[:, :, P : P + t], values[:, :, P : P + t] = k[rows, :, :t], v[rows, :, :t]
            feeds = {PROJECTED_NAMES[0]: np.ascontiguousarray(q[rows, :, :t]), PAST_LENGTH_NAME: np.array(P, np.int64)}
            feeds.update(zip(CACHE_NAMES, (keys, values), strict=True))
            out.append(self.attend.run([OUTPUT_NAME], feeds)[0])  # (B, t, C)
            row += B
        return out


class CudaSteps:
    """Decode steps with the caches in device memory (torch tensors on this device), bound in
    place with IOBinding: the new tokens of every sequence projected in one run, then each
    sequence's attention over its whole cache; only x and y cross the bus."""

    def __init__(self, project: ort.InferenceSession, attend: ort.InferenceSession, device_id: int) -> None:
        self.project, self.attend, self.device_id = project, attend, device_id

    def _bind(self, binding: ort.IOBinding, name: str, tensor: torch.Tensor, output: bool = False) -> None:
        bind = binding.bind_output if output else binding.bind_input
        bind(name, "cuda", self.device_id, np.float32, list(tensor.shape), tensor.data_ptr())

    def run(self, steps: Sequence[Step]) -> list[np.ndarray]:
        merged = merge([s.x for s in steps])  # (R, t_max, C), right-padded
        _, nh, _, hs = steps[0].cache.keys.shape
        device = steps[0].cache.keys.device
        projected = [torch.empty((merged.shape[0], nh, merged.shape[1], hs), device=device) for _ in PROJECTED_NAMES]
        binding = self.project.io_binding()
        binding.bind_cpu_input(INPUT_NAME, np.ascontiguousarray(merged))
        for name, tensor in zip(PROJECTED_NAMES, projected, strict=True):
            self._bind(binding, name, tensor, output=True)
        self.project.run_with_iobinding(binding)  # returns once ORT's stream is done
        q, k, v = projected  # (R, nh, t_max, hs) each
        out, row = [], 0
        for step in steps:
            (B, t), P = step.x.shape[:2], step.cache.length
            rows = slice(row, row + B)
            keys, values = step.cache.keys, step.cache.values  # (B, nh, capacity, hs), contiguous
            keys.narrow(2, P, t).copy_(k[rows, :, :t])
            values.narrow(2, P, t).copy_(v[rows, :, :t])
            query = q[rows, :, :t].contiguous()  # (B, nh, t, hs)
            binding = self.attend.io_binding()
            for name, tensor in zip((PROJECTED_NAMES[0], *CACHE_NAMES), (query, keys, values), strict=True):
                self._bind(binding, name, tensor)
            binding.bind_cpu_input(PAST_LENGTH_NAME, np.array(P, np.int64))
            binding.bind_output(OUTPUT_NAME, "cpu")
            torch.cuda.current_stream(device).synchronize()  # the copies above, made on torch's stream
            self.attend.run_with_iobinding(binding)
            out.append(binding.get_outputs()[0].numpy())  # (B, t, C)
            row += B
        return out


COMPUTE_OPS = ("Attention", "MatMul", "Gemm", "Softmax")  # where the FLOPs are: these must run on the GPU
_PLACED = re.compile(r"(All nodes|Node\(s\)) placed on \[(\w+)\]\. Number of nodes: (\d+)")
_NODE = re.compile(r"\]\s+(\w+) \(([^)]*)\)\s*$")


def parse_placements(log_text: str) -> dict[str, list[str]]:
    """Node placements from ONNX Runtime's verbose session log: provider -> the op types placed
    on it ("*" for "all nodes"), as VerifyEachNodeIsAssignedToAnEp writes them."""
    placements: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in log_text.splitlines():
        if (match := _PLACED.search(line)) is not None:
            everything, provider = match.group(1) == "All nodes", match.group(2)
            current = placements.setdefault(provider, [])
            if everything:
                current.append("*")
                current = None
            continue
        if current is not None and "VerifyEachNodeIsAssignedToAnEp" in line and (node := _NODE.search(line)):
            current.append(node.group(1))
    return placements


def node_placements(model_path: Path, providers: list[str | tuple[str, dict[str, object]]]) -> dict[str, list[str]]:
    """Where ONNX Runtime places each node of `model_path` with `providers`: a session created
    with verbose logging, its log (written by ORT's C++ code to fd 2) captured and parsed."""
    options = ort.SessionOptions()
    options.log_severity_level = 0
    options.log_verbosity_level = 0
    with tempfile.TemporaryFile(mode="w+b") as captured:
        saved = os.dup(2)
        try:
            os.dup2(captured.fileno(), 2)
            _load_session(model_path, options, providers)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return parse_placements(captured.read().decode(errors="replace"))


def off_device(placements: dict[str, list[str]], provider: str) -> list[str]:
    """The compute-heavy op types that `placements` puts anywhere but on `provider` ("every
    node" when another provider took them all; everything when the log said nothing)."""
    if not placements:
        return ["every node (ONNX Runtime logged no placements)"]
    stray = set()
    for ep, ops in placements.items():
        if ep != provider:
            stray |= {"every node" if op == "*" else op for op in ops if op == "*" or op in COMPUTE_OPS}
    return sorted(stray)


def describe_placements(placements: dict[str, list[str]]) -> str:
    return "; ".join(
        f"all nodes on {ep}" if ops == ["*"] else f"{len(ops)} nodes on {ep}" for ep, ops in placements.items()
    )


def cuda_provider_options(device_id: int, mem_limit_mb: int) -> dict[str, object]:
    """The CUDA provider's options; `mem_limit_mb` > 0 caps ORT's arena (gpu_mem_limit), which
    otherwise grows beside PyTorch's caching allocator on the same device until one runs out."""
    options: dict[str, object] = {
        "device_id": device_id,
        "arena_extend_strategy": "kSameAsRequested",
        "use_tf32": 0,  # fp32 parity against the float64 reference needs full fp32 matmuls
        "cudnn_conv_algo_search": "DEFAULT",
    }
    if mem_limit_mb > 0:
        options["gpu_mem_limit"] = mem_limit_mb * 2**20
    return options


class OrtCudaBackend(Backend):
    """ORT's CUDA provider, confirmed by get_providers(). A batch's input and output live in host
    memory, and session.run copies them across itself: binding them with IOBinding measured about
    twice as slow from (8, 2048, 512) up (bench/results/gpu_check.json, docs/gpu.md)."""

    name = "ort-cuda"
    platform = "onnxruntime_onnx"

    def __init__(
        self, model_path: Path, device_id: int = 0, mem_limit_mb: int = 0, step_paths: tuple[Path, Path] | None = None
    ) -> None:
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise BackendLoadError(
                f"this onnxruntime build has no CUDA provider (available: {ort.get_available_providers()})"
            )
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        cuda: list[str | tuple[str, dict[str, object]]] = [
            ("CUDAExecutionProvider", cuda_provider_options(device_id, mem_limit_mb)),
            "CPUExecutionProvider",
        ]
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = _load_session(model_path, options, cuda)
        providers = session.get_providers()
        if not providers or providers[0] != "CUDAExecutionProvider":
            raise BackendLoadError(f"ONNX Runtime did not enable the CUDA provider: session providers are {providers}")
        self.placements = node_placements(model_path, cuda)
        if stray := off_device(self.placements, "CUDAExecutionProvider"):
            raise BackendLoadError(f"ONNX Runtime placed {', '.join(stray)} off the GPU: {self.placements}")
        self._session = session
        self.providers: list[str] = providers  # confirmed: CUDAExecutionProvider first
        self._input = session.get_inputs()[0].name
        self._output = session.get_outputs()[0].name
        self.device = f"cuda:{device_id}"
        self._steps = _cuda_steps(step_paths, options, cuda, device_id) if step_paths is not None else None

    @property
    def placement(self) -> str:
        """Where ORT placed the graph's nodes, as the selection's reason reports it."""
        return describe_placements(self.placements)

    @property
    def steps(self) -> bool:
        return self._steps is not None

    def step(self, steps: Sequence[Step]) -> list[np.ndarray]:
        if self._steps is None:
            return super().step(steps)
        return self._steps.run(steps)

    def run(self, x: np.ndarray) -> np.ndarray:
        return self._session.run([self._output], {self._input: x})[0]
