"""The model repository as the app reads it: each model's `config.pbtxt` (Triton's model
configuration, protobuf text) for its `version_policy`, and poll mode's loop."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from google.protobuf import text_format

from service.engine.core import InferenceCore, single_source
from service.engine.repository import ModelSource, VersionPolicy
from service.proto import grpc_service_pb2 as pb
from service.settings import Settings

log = logging.getLogger(__name__)
CONFIG_FILE = "config.pbtxt"  # Triton's name for it; the other fields are Triton's business


def read_policy(folder: Path) -> VersionPolicy:
    """The version_policy of `folder`/config.pbtxt (none, or no file: Triton's default, the latest
    version). Raises ValueError naming the file when it cannot be read as a model configuration."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        return VersionPolicy()
    try:
        config = text_format.Parse(path.read_text(), pb.ModelConfig(), allow_unknown_field=True)
    except (text_format.ParseError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a model configuration Triton could read: {exc}") from exc
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return VersionPolicy("all")
    if which == "specific":
        return VersionPolicy("specific", versions=tuple(policy.specific.versions))
    if which == "latest":
        return VersionPolicy("latest", count=max(1, policy.latest.num_versions))
    return VersionPolicy()


def model_source(settings: Settings) -> ModelSource:
    """Where the settings say the model's versions are, each model's policy read from its config.pbtxt."""
    return single_source(settings, read_policy)


async def poll(core: InferenceCore, stop: asyncio.Event) -> None:
    """--model-control-mode poll: read the repository again every --repository-poll-secs, until
    `stop` is set. A refused version is said once, and tried again once its files change."""
    period = core.settings.repository_poll_secs
    while not stop.is_set():
        await core.clock.wait(stop, core.clock.now() + period)
        if stop.is_set():
            return
        try:
            await core.keeper.sync(polled=True)
        except Exception as exc:  # draining, or a fault: the next poll tries again
            log.warning("polling the repository failed: %s", exc)
