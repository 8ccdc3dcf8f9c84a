"""What the benchmark scripts share: their command line and where results go.

The scripts run as `python bench/NAME.py`, so this folder is on sys.path and `import common` works.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser described by the script's docstring, with logging set up."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    return argparse.ArgumentParser(description=(doc or "").splitlines()[0])


def write_json(name: str, payload: object) -> Path:
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path
