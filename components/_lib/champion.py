"""Champion against challenger, and drift (called by the KFP component components/champion.py and the tests).

Every night, before the gate:
  1. tonight's data profile (gr2/drift.py) is uploaded to the artifact store as `<run_id>/data_profile`: what a
     later night compares against if tonight's model is promoted;
  2. when a model is in production, the attempt the pointer pins is downloaded (hash-checked) and scored on
     tonight's test lists beside the candidate: the paired comparison the gate's production rule reads
     (gr2.gate.paired_comparison), and prediction drift; a production model that cannot be downloaded or
     loaded is an error in the result, which fails the gate's rule (never a skipped rule);
  3. data drift of tonight against production's night (its run's data profile);
  4. champion.json (all of it, also uploaded as `<run_id>/champion` for the run's outcome) and drift.md.
Without a production model only step 1 runs, and nothing heavy is imported.

`store`: where the artifact store lives, as `open_store`'s keyword arguments; empty values mean the defaults
(the environment: the ConfigMap and Secret on a cluster, else the local store).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from components._lib import sources
from components._lib.steps import as_profile, load_evidence
from gr2.config import Profile

DATA_PROFILE = "data_profile"  # the artifact-store stage of a night's data profile
CHAMPION = "champion"  # ... and of this step's result


def read_comparison(out_dir: str | Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(production record, paired comparison) from a champion output folder: what the gate decides on."""
    scored = json.loads((Path(out_dir) / "champion.json").read_text())
    return scored["production"], scored["paired"]


def _score_production(store: Any, test, candidate_dir: str | Path, prof: Profile) -> dict[str, Any]:
    """Production's and the candidate's rankings of `test`: {"paired", "predictions"} or {"error"}."""
    import torch

    from gr2.drift import prediction_drift
    from gr2.gate import paired_comparison
    from gr2.generative import bundle_dir
    from gr2.inference import load_reranker
    from gr2.stages.evaluate import rankings

    torch.set_num_threads(prof.eval.threads)
    with tempfile.TemporaryDirectory(prefix="gr2-production-") as tmp:
        try:
            prod = load_reranker(bundle_dir(store.download_production(Path(tmp) / "production")))
            # the production model at its own operating point (its bundle's tau), as it serves
            prod_ranks, unknown = rankings(prod, test, getattr(prod, "tau", None), prof)
        except Exception as e:  # any reason it cannot be scored fails the gate's rule, named
            return {"error": f"{type(e).__name__}: {e}"}
    cand = load_reranker(bundle_dir(candidate_dir))
    cand_ranks, _ = rankings(cand, test, getattr(cand, "tau", None), prof)  # at its own operating tau
    paired = paired_comparison(test, cand_ranks, prod_ranks, prof.bootstrap_samples, prof.seed)
    paired["production_unknown_lists"] = unknown  # lists production could not read (upstream order)
    return {"paired": paired, "predictions": prediction_drift(prod_ranks, cand_ranks)}


def champion(
    sources_dir: str | Path,
    examples_path: str | Path,
    candidate_dir: str | Path,
    out_dir: str | Path,
    profile: str | Profile,
    run_id: str,
    store: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Steps 1-4 of the module docstring; returns champion.json's content."""
    from components.artifact_store import ArtifactError, open_store
    from gr2.drift import DataProfile, data_drift, data_profile, drift_markdown, warnings

    t0 = time.perf_counter()
    prof = as_profile(profile)
    st = open_store(**{k: v or None for k, v in (store or {}).items()})
    test = sources.read_test_lists(examples_path, prof.data.max_eval_examples)
    ev = load_evidence(sources_dir)
    meta = sources.read_meta(sources_dir)
    tonight = data_profile(
        sources.read_dataset(sources_dir, event_ts=False).interactions,
        ev.features_batch(test["history"].tolist(), test["candidates"].tolist()),
        ev.feature_names,
        prof.data.history_len,
        meta.get("snapshot_date", ""),
        prof.drift,
        prof.seed,
    )
    with tempfile.TemporaryDirectory(prefix="gr2-data-profile-") as tmp:
        st.upload(run_id, DATA_PROFILE, tonight.save(tmp))

    production = st.production()
    drift: dict[str, Any] = {"production": production}
    result: dict[str, Any] = {"run_id": run_id, "snapshot_date": meta.get("snapshot_date", "")}
    result.update(production=production, paired=None, n_test_lists=len(test))
    if production is not None:
        scored = _score_production(st, test, candidate_dir, prof)
        if "error" in scored:
            result["paired"] = {"error": f"production model could not be loaded: {scored['error']}"}
            drift["predictions_error"] = result["paired"]["error"]
        else:
            result["paired"], drift["predictions"] = scored["paired"], scored["predictions"]
        with tempfile.TemporaryDirectory(prefix="gr2-reference-") as tmp:
            try:
                reference = DataProfile.load(st.download(production["run_id"], DATA_PROFILE, tmp))
                drift["data"] = data_drift(reference, tonight, prof.drift)
            except (ArtifactError, KeyError, OSError) as e:
                drift["data_error"] = f"no data profile of production's run {production.get('run_id')!r}: {e}"
    drift["warnings"] = warnings(drift, prof.drift) if production is not None else []
    result["drift"] = drift
    result["seconds"] = round(time.perf_counter() - t0, 2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "champion.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "drift.md").write_text(drift_markdown(drift, prof.drift))
    st.upload(run_id, CHAMPION, report=json.loads((out / "champion.json").read_text()))
    return result
