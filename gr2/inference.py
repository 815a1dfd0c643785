"""The inference API shared by serving and evaluation (docs/CONTRACTS.md, "Inference API").

A `Reranker` turns `RankRequest`s (a user's history plus candidates in upstream order) into `RankResult`s.
Implementations live in model directories that carry a `reranker.json` with a `kind` field;
`load_reranker(path)` dispatches on it through a small registry, so the generative implementation only has
to call `register_reranker("generative")` on its loader to become servable.

`FloorReranker` is the pre-rank floor as a real model: it returns the upstream (retriever) order, is always
valid and spends no decoding steps (nfe 0). It is the baseline every other model must beat, and a safe
model for wiring up serving before a trained model exists.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

CONFIG_FILE = "reranker.json"  # the one file every model directory has; `kind` selects the loader
ITEMS_FILE = "items.txt"  # the item catalogue, one id per line (what `known_item` answers from)
VERIFIER_DIR = (
    "verifier"  # a generative bundle's spec verifier: the folder, and the reranker.json key naming it
)
DECODERS = ("diffusion", "ar", "spec")  # spec: lossless speculative decoding (gr2/decode.py spec_generate)
DTYPES = ("float32", "bfloat16")  # what a generative model may decode in (serving's --dtype)


@dataclass(frozen=True)
class RankRequest:
    user_id: str
    candidates: list[str]  # item ids in upstream (retriever) order
    history: list[str]  # item ids, oldest -> newest


@dataclass(frozen=True)
class RankResult:
    ranking: list[str]  # the candidates, best first (a permutation of the request's candidates)
    valid: bool  # False when the model's output was unusable and `ranking` is the upstream-order fallback
    reason: str | None  # why the output was invalid (None when valid)
    nfe: int  # number of function (forward) evaluations spent decoding
    n_tokens: int  # tokens generated
    trace: str | None  # the reasoning trace, when the model writes one
    # Who ranked: "model" (the reranker itself) or "cold_start" (a user without usable history: the bundle's
    # cold-start ranker, gr2/generative.py)
    ranker: str = "model"


@runtime_checkable
class Reranker(Protocol):
    name: str
    n_candidates: int

    def known_item(self, item_id: str) -> bool: ...

    def rank(
        self, requests: list[RankRequest], decoder: str = "diffusion", tau: float | None = None
    ) -> list[RankResult]:
        """tau None: the model's own operating tau (its bundle's; gr2.config.DiffusionConfig.eval_tau when the
        bundle records none)."""
        ...


class RerankerLoadError(ValueError):
    """A model directory that cannot be loaded (missing/invalid reranker.json, unknown kind)."""


_LOADERS: dict[str, Callable[[Path, dict], Reranker]] = {}


# Kinds whose loader lives in a heavier module (torch, transformers), imported on first use.
_KIND_MODULES = {"generative": "gr2.generative"}


def register_reranker(
    kind: str,
) -> Callable[[Callable[[Path, dict], Reranker]], Callable[[Path, dict], Reranker]]:
    """Decorator: register `loader(path, config) -> Reranker` for model directories of this `kind`."""

    def deco(loader: Callable[[Path, dict], Reranker]) -> Callable[[Path, dict], Reranker]:
        _LOADERS[kind] = loader
        return loader

    return deco


def read_config(path: str | Path) -> dict:
    """Read and check `<path>/reranker.json` (must be a JSON object with a string `kind`)."""
    cfg_path = Path(path) / CONFIG_FILE
    if not cfg_path.is_file():
        raise RerankerLoadError(f"{cfg_path}: missing; a model directory needs a {CONFIG_FILE} with a 'kind'")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise RerankerLoadError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("kind"), str):
        raise RerankerLoadError(f"{cfg_path}: expected a JSON object with a string field 'kind'")
    return cfg


def load_reranker(path: str | Path) -> Reranker:
    """Load the reranker stored in the model directory `path`, dispatching on `reranker.json`'s `kind`."""
    path = Path(path)
    cfg = read_config(path)
    if cfg["kind"] in _KIND_MODULES and cfg["kind"] not in _LOADERS:
        importlib.import_module(_KIND_MODULES[cfg["kind"]])  # registers its loader (kept out of import time)
    loader = _LOADERS.get(cfg["kind"])
    if loader is None:
        raise RerankerLoadError(
            f"{path / CONFIG_FILE}: unknown kind {cfg['kind']!r}; registered kinds: {sorted(_LOADERS)}"
        )
    return loader(path, cfg)


def _read_items(path: Path) -> frozenset[str] | None:
    f = path / ITEMS_FILE
    if not f.is_file():
        return None
    return frozenset(line.strip() for line in f.read_text().splitlines() if line.strip())


class FloorReranker:
    """The pre-rank floor: keeps the upstream order. Always valid, nfe 0, no trace.

    `items` is the catalogue `known_item` answers from; None means every item id is accepted (the floor
    itself needs no item knowledge, but a served floor should reject ids the platform has never seen).
    """

    kind = "floor"

    def __init__(self, name: str = "floor", n_candidates: int = 10, items: Iterable[str] | None = None):
        self.name = name
        self.n_candidates = n_candidates
        self.items = frozenset(items) if items is not None else None

    def known_item(self, item_id: str) -> bool:
        return self.items is None or item_id in self.items

    def rank(
        self, requests: list[RankRequest], decoder: str = "diffusion", tau: float | None = None
    ) -> list[RankResult]:
        # decoder and tau are accepted for interface compatibility; the floor does not decode.
        return [
            RankResult(ranking=list(r.candidates), valid=True, reason=None, nfe=0, n_tokens=0, trace=None)
            for r in requests
        ]

    def save(self, path: str | Path) -> Path:
        """Write a loadable model directory (reranker.json + items.txt when a catalogue is set)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = {"kind": self.kind, "name": self.name, "n_candidates": self.n_candidates}
        (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
        if self.items is not None:
            (path / ITEMS_FILE).write_text("".join(f"{i}\n" for i in sorted(self.items)))
        return path


@register_reranker("floor")
def _load_floor(path: Path, cfg: dict) -> FloorReranker:
    n = cfg.get("n_candidates", 10)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise RerankerLoadError(f"{path / CONFIG_FILE}: n_candidates must be a positive integer, got {n!r}")
    return FloorReranker(name=str(cfg.get("name", "floor")), n_candidates=n, items=_read_items(path))
