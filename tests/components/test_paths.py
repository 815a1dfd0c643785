"""repo_relative: committed reports name files relative to the repository, never by a machine's path."""

from components._lib.paths import REPO_ROOT, repo_relative


def test_repo_relative_rewrites_paths_under_the_repo_only():
    report = {
        "loss_curve": str(REPO_ROOT / "runs" / "r1" / "loss_curve.png"),
        "rows": [{"model_uri": str(REPO_ROOT / "runs" / "r1" / "bundle"), "recall@1": 0.4}],
        "elsewhere": "/data/outside/file.parquet",
        "n": 3,
    }
    out = repo_relative(report)
    assert out["loss_curve"] == "runs/r1/loss_curve.png"
    assert out["rows"][0] == {"model_uri": "runs/r1/bundle", "recall@1": 0.4}
    assert out["elsewhere"] == "/data/outside/file.parquet" and out["n"] == 3
    assert repo_relative(str(REPO_ROOT) + "x/y") == str(REPO_ROOT) + "x/y"  # a sibling folder is not inside
    # Inside text too (a model card's lines), every occurrence.
    card = f"- parent: `{REPO_ROOT / 'runs' / 'a'}`\n- loss_curve {REPO_ROOT / 'runs' / 'b.png'}\n"
    assert repo_relative(card) == "- parent: `runs/a`\n- loss_curve runs/b.png\n"
