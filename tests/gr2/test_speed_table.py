"""speed_table interleaves the plans chunk by chunk and reports each speedup's geometric mean over the repeats with
its 95% interval: scripted decode times, exact expected figures."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest

from gr2.config import EvalConfig
from gr2.generative import Decoded
from gr2.stages.evaluate import speed_table


class _Scripted:
    """A reranker whose decode takes scripted seconds per call and writes 10 tokens per prompt in `nfe` forwards."""

    def __init__(self, name: str, seconds: list[float], nfe: int, log: list):
        self.name, self.seconds, self.nfe, self.log = name, list(seconds), nfe, log

    def encode_prompts(self, histories, candidates):
        return [[1, 2, 3] for _ in histories]

    def decode(self, prompts, decoder, tau, batch_size):
        self.log.append((self.name, len(prompts), batch_size))
        n_batches = -(-len(prompts) // batch_size)
        return Decoded([[5] * 10 for _ in prompts], self.nfe * n_batches, self.seconds.pop(0))


def per_call(totals: list[float], calls: int) -> list[float]:
    """Each repeat's total split evenly over its decode calls (one per chunk)."""
    return [t / calls for t in totals for _ in range(calls)]


def test_speed_rows_interleave_chunks_and_report_the_interval():
    test = pd.DataFrame({"history": [["a"]] * 4, "candidates": [["b"]] * 4})
    ev = dataclasses.replace(
        EvalConfig(), speed_examples=4, speed_batch=2, speed_batch_examples=4, speed_repeats=3
    )
    log: list = []
    # Per repeat: AR takes 1, 2, 1 s at batch 1 and 1 s at batch 2; diffusion 0.5, 0.5, 2 s and 0.25, 0.5, 0.5 s.
    ar = _Scripted("ar", per_call([1.0, 2.0, 1.0], 4) + per_call([1.0, 1.0, 1.0], 2), nfe=10, log=log)
    diff = _Scripted("cft", per_call([0.5, 0.5, 2.0], 4) + per_call([0.25, 0.5, 0.5], 2), nfe=4, log=log)
    rows = speed_table({"ar": ar, "cft": diff}, [("ar", "ar", None), ("cft", "diffusion", 0.9)], test, ev)
    assert [(r["model"], r["batch"], r["repeats"]) for r in rows] == [
        ("ar", 1, 3),
        ("cft", 1, 3),
        ("ar", 2, 3),
        ("cft", 2, 3),
    ]
    a1, d1, a2, d2 = rows
    assert a1["speedup_vs_ar"] == 1.0 and a1["speedup_ci95"] == [1.0, 1.0]
    assert a1["tokens_per_s"] == pytest.approx(40 / 1.0)  # median over the repeats
    assert d1["tokens_per_s"] == pytest.approx(40 / 0.5)
    t = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom
    for row, ratios in ((d1, [2.0, 4.0, 0.5]), (d2, [4.0, 2.0, 2.0])):  # per repeat: AR seconds / cft seconds
        logs = [math.log(r) for r in ratios]
        mean = sum(logs) / 3
        half = t * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3)
        assert row["speedup_vs_ar"] == pytest.approx(math.exp(mean))
        assert row["speedup_ci95"] == pytest.approx([math.exp(mean - half), math.exp(mean + half)])
    assert d1["ideal_speedup"] == pytest.approx(10 / 4) and d1["seconds"] == pytest.approx(3.0)
    # Interleaved chunk by chunk: each chunk is decoded by every plan before the next chunk.
    b1 = [x for x in log if x[2] == 1]
    assert b1 == [("ar", 1, 1), ("cft", 1, 1)] * 12
    assert [x for x in log if x[2] == 2] == [("ar", 2, 2), ("cft", 2, 2)] * 6
