"""Where the versions to serve come from: Triton's model repository layout (`DIR/<model>/<version>/`,
each version a directory `mha export` wrote) or one model directory (`--model-dir`, a repository of
one version), and which of the versions present to serve (`version_policy`, as Triton's model
config states it: the latest N, all, or specific ones).

The policy is read by a function the app passes in (Triton's `config.pbtxt` is a protobuf text
file, and this layer speaks no protobuf)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
MAX_VERSION = 2**63 - 1  # Triton's versions are int64


@dataclass(frozen=True)
class VersionPolicy:
    """Triton's ModelVersionPolicy: `latest` (the `count` highest versions), `all`, or `specific`."""

    kind: str = "latest"
    count: int = 1
    versions: tuple[int, ...] = ()

    def choose(self, available: Iterable[int]) -> list[int]:
        """The versions to serve among `available`, lowest first."""
        present = sorted(set(available))
        if self.kind == "all":
            return present
        if self.kind == "specific":
            return [v for v in present if v in self.versions]
        return present[-self.count :] if self.count > 0 else []

    def describe(self) -> str:
        if self.kind == "all":
            return "all versions"
        if self.kind == "specific":
            return f"versions {list(self.versions)}"
        return f"the latest {self.count} version{'s' if self.count != 1 else ''}"


PolicyReader = Callable[[Path], VersionPolicy]  # the model's folder -> its policy (ValueError: unreadable)


def version_number(name: str) -> int | None:
    """A version folder's number: Triton's versions are positive decimal integers."""
    if not name.isascii() or not name.isdigit():
        return None
    number = int(name)
    return number if 0 < number <= MAX_VERSION else None


@dataclass(frozen=True)
class ModelSource:
    """The versions of one model: in `repository/<name>/` (read again at each load or poll), or
    the one `directory`."""

    name: str
    repository: Path | None = None
    directory: Path | None = None
    version: str = "1"  # the one directory's version
    read_policy: PolicyReader | None = None

    @property
    def folder(self) -> Path | None:
        return self.repository / self.name if self.repository is not None else None

    def wanted(self) -> tuple[dict[str, Path | None], VersionPolicy]:
        """The versions the policy serves now ({version: directory}, lowest first), and the policy.
        Raises FileNotFoundError when the model has no folder, ValueError when its policy is
        unreadable or chooses none of its versions."""
        folder = self.folder
        if folder is None:
            return {self.version: self.directory}, VersionPolicy()
        if not folder.is_dir():
            raise FileNotFoundError(f"the repository {self.repository} has no folder {self.name}/")
        policy = self.read_policy(folder) if self.read_policy is not None else VersionPolicy()
        present = _version_folders(folder)
        if not (chosen := policy.choose(present)):  # Triton refuses it too: nothing would serve
            there = f"versions {sorted(present)}" if present else "no version folder (1/, 2/, ...)"
            raise ValueError(
                f"{folder}/ holds {there}, and its version_policy serves {policy.describe()}: "
                "at least one version must be available under the policy"
            )
        return {str(v): present[v] for v in chosen}, policy


def _version_folders(folder: Path) -> dict[int, Path]:
    """{version: its folder}; ValueError where two folders are one version (1/ and 01/): which of
    them would serve would depend on the order the file system lists them in."""
    present: dict[int, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.is_dir() and (n := version_number(path.name)):
            if n in present:
                raise ValueError(
                    f"{folder}/ holds {present[n].name}/ and {path.name}/, both version {n}: keep one of them"
                )
            present[n] = path
    return present
