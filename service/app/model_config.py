"""Each model's `config.pbtxt` (Triton's model configuration, protobuf text) as the app reads it:
its `version_policy` and its dynamic batcher's priority levels and queue policies. Light: the
supervisor of `--workers` reads it before any worker starts."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format

from service.engine.sources import VersionPolicy
from service.proto import grpc_service_pb2 as pb
from service.scheduling import QueuePolicy, SchedulePolicy
from service.settings import Settings, schedule_policy

CONFIG_FILE = "config.pbtxt"  # Triton's name for it; the other fields are Triton's business


def _config(path: Path) -> pb.ModelConfig:
    """`path` read as a model configuration (no file: an empty one)."""
    if not path.is_file():
        return pb.ModelConfig()
    try:
        return text_format.Parse(path.read_text(), pb.ModelConfig(), allow_unknown_field=True)
    except (text_format.ParseError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a model configuration Triton could read: {exc}") from exc


def read_policy(folder: Path) -> VersionPolicy:
    """The version_policy of `folder`/config.pbtxt (none, or no file: Triton's default, the latest
    version). Raises ValueError naming the file when it cannot be read as a model configuration."""
    policy = _config(folder / CONFIG_FILE).version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return VersionPolicy("all")
    if which == "specific":
        return VersionPolicy("specific", versions=tuple(policy.specific.versions))
    if which == "latest":
        return VersionPolicy("latest", count=max(1, policy.latest.num_versions))
    return VersionPolicy()


def read_schedule(settings: Settings) -> SchedulePolicy:
    """The stateless model's schedule policy: its config.pbtxt's dynamic_batching priority fields
    where the repository's config sets them (Triton's way), else the flags'. Raises ValueError
    naming the file when they do not hold together."""
    flags = schedule_policy(settings)
    if settings.model_repository is None:
        return flags
    path = settings.model_repository / settings.model_name / CONFIG_FILE
    batching = _config(path).dynamic_batching
    if not (batching.priority_levels or batching.HasField("default_queue_policy") or batching.priority_queue_policy):
        return flags
    levels = max(1, batching.priority_levels)
    try:
        return SchedulePolicy(
            priority_levels=levels,
            default_priority_level=batching.default_priority_level or 1,
            default_queue_policy=_queue_policy(batching.default_queue_policy),
            priority_queue_policy={int(k): _queue_policy(v) for k, v in batching.priority_queue_policy.items()},
            max_overtakes=flags.max_overtakes,
        )
    except ValueError as exc:
        raise ValueError(f"{path}: dynamic_batching: {exc}") from None


def _queue_policy(policy: pb.ModelQueuePolicy) -> QueuePolicy:
    return QueuePolicy(
        timeout_action=pb.ModelQueuePolicy.TimeoutAction.Name(policy.timeout_action),
        default_timeout_microseconds=policy.default_timeout_microseconds,
        allow_timeout_override=policy.allow_timeout_override,
        max_queue_size=policy.max_queue_size,
    )
