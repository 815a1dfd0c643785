"""A canary predictor revision with a deterministic fault, for the canary-analysis tests: the real
RerankPredictor, micro-batcher, metrics and KServe server (serving/modelserver.py) around the served model
wrapped so that it decodes 8 tokens in 2 forwards (tokens per forward 4) and, per the fault named in
--fault_file (read at every model call, so one process plays every scenario in turn):

    none     answers as the model does (valid)
    error    raises on every call (HTTP 500)
    slow     sleeps SLOW_S seconds per call, then answers (far above any latency threshold of the tests)
    invalid  marks every answer invalid (the fallback: the upstream order)

    python -m tests.deploy.canary_server --model_dir DIR --port PORT --fault_file FILE
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from gr2.inference import DECODERS, RankResult, load_reranker

FAULTS = ("none", "error", "slow", "invalid")
SLOW_S = 11.0  # its p99 lands in the (10 s, 30 s] latency bucket, above the tests' 10 s slack


class FaultyReranker:
    def __init__(self, inner, fault_file: Path):
        self.inner, self.fault_file = inner, fault_file
        self.name, self.n_candidates = inner.name, inner.n_candidates
        # what the predictor reads of a model: its decoders and default taus, so the canary serves as stable does
        self.decoders = getattr(inner, "decoders", DECODERS)
        self.tau, self.spec_tau = getattr(inner, "tau", None), getattr(inner, "spec_tau", None)

    def known_item(self, item_id: str) -> bool:
        return self.inner.known_item(item_id)

    def rank(self, requests, decoder="diffusion", tau=0.9):
        fault = self.fault_file.read_text().strip()
        assert fault in FAULTS, fault
        if fault == "error":
            raise RuntimeError("injected fault: the model failed")
        if fault == "slow":
            time.sleep(SLOW_S)
        valid = fault != "invalid"
        return [
            RankResult(r.ranking, valid, None if valid else "injected fault: unusable output", 2, 8, None)
            for r in self.inner.rank(requests, decoder, tau)
        ]


def main() -> None:
    from serving.modelserver import start_model_server
    from serving.predictor import RerankPredictor

    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--fault_file", type=Path, required=True)
    a, _ = ap.parse_known_args()  # kserve parses sys.argv too
    reranker = FaultyReranker(load_reranker(a.model_dir), a.fault_file)
    start_model_server([RerankPredictor("reranker", reranker=reranker)], a.port)


if __name__ == "__main__":
    main()
