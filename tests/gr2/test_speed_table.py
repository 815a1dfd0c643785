"""speed_table repeats the plans interleaved and keeps medians: scripted decode times, exact expected figures."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from gr2.config import EvalConfig
from gr2.generative import Decoded
from gr2.stages.evaluate import speed_table


class _Scripted:
    """A reranker whose decode takes scripted seconds per call and writes 10 tokens per prompt in `nfe` forwards."""

    def __init__(self, name: str, seconds: list[float], nfe: int):
        self.name, self.seconds, self.nfe, self.calls = name, list(seconds), nfe, []

    def encode_prompts(self, histories, candidates):
        return [[1, 2, 3] for _ in histories]

    def decode(self, prompts, decoder, tau, batch_size):
        self.calls.append((decoder, tau, batch_size))
        n_batches = -(-len(prompts) // batch_size)
        return Decoded([[5] * 10 for _ in prompts], self.nfe * n_batches, self.seconds.pop(0))


def test_speed_rows_are_medians_of_interleaved_repeats():
    test = pd.DataFrame({"history": [["a"]] * 4, "candidates": [["b"]] * 4})
    ev = dataclasses.replace(
        EvalConfig(), speed_examples=4, speed_batch=2, speed_batch_examples=4, speed_repeats=3
    )
    # Per repeat, batch 1 then batch 2: AR takes 1, 2, 1 s; diffusion 0.5, 0.5, 2 s -> ratios 2, 4, 0.5.
    ar = _Scripted("ar", [1.0, 2.0, 1.0, 1.0, 1.0, 1.0], nfe=10)
    diff = _Scripted("cft", [0.5, 0.5, 2.0, 0.25, 0.5, 0.5], nfe=4)
    rows = speed_table({"ar": ar, "cft": diff}, [("ar", "ar", None), ("cft", "diffusion", 0.9)], test, ev)
    assert [(r["model"], r["batch"], r["repeats"]) for r in rows] == [
        ("ar", 1, 3),
        ("cft", 1, 3),
        ("ar", 2, 3),
        ("cft", 2, 3),
    ]
    a1, d1, a2, d2 = rows
    assert a1["tokens_per_s"] == pytest.approx(40 / 1.0) and a1["speedup_vs_ar"] == 1.0
    assert d1["tokens_per_s"] == pytest.approx(40 / 0.5)
    assert d1["speedup_vs_ar"] == pytest.approx(2.0)  # median of the paired ratios 2, 4, 0.5
    assert d1["ideal_speedup"] == pytest.approx(10 / 4) and d1["seconds"] == pytest.approx(3.0)
    assert d2["speedup_vs_ar"] == pytest.approx(2.0)  # ratios 4, 2, 2
    # Interleaved: each model was called once per repeat, in plan order.
    assert ar.calls == [("ar", 1.0, 1)] * 3 + [("ar", 1.0, 2)] * 3
    assert diff.calls == [("diffusion", 0.9, 1)] * 3 + [("diffusion", 0.9, 2)] * 3
