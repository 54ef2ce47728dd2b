"""Token ids -> text pieces for the token view, with the run's own tokenizer when it can be found.

Records hold token ids only. The tokenizer is the run config's `engine.tokenizer` (or
`engine.model`), or the one given with `--tokenizer`; it is loaded lazily, from local files only,
and only when transformers is installed. Without it the page shows ids.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("agentrl.dashboard")


def tokenizer_path(config: dict[str, Any] | None, override: str | None = None) -> str | None:
    if override:
        return override
    engine = (config or {}).get("engine") or {}
    path = engine.get("tokenizer") or engine.get("model")
    return path if path and Path(path).is_dir() else None


class TokenDecoder:
    """Loads one tokenizer per path once; `pieces` decodes each id on its own."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def _load(self, path: str) -> Any:
        if path not in self._cache:
            try:
                from transformers import AutoTokenizer

                self._cache[path] = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except Exception as exc:  # any failure means "show ids", never a broken page
                log.info("no tokenizer at %s: %s", path, exc)
                self._cache[path] = None
        return self._cache[path]

    def pieces(self, path: str | None, ids: list[int]) -> list[str] | None:
        tok = self._load(path) if path else None
        if tok is None:
            return None
        return list(tok.batch_decode([[i] for i in ids], skip_special_tokens=False))
