"""The split by position (TIGER leave-one-out, or its k-position generalisation), and strictly increasing event
times for the feature store.

Per user with n items (positions = seq_idx 0..n-1) and k = `eval_positions` (1 = leave-one-out, the papers'
protocol): the last k positions are test targets, the k before them validation targets, the rest training
targets (sliding windows). The history of a target at position p is the up-to-H items at positions
max(0, p-H)..p-1, oldest -> newest. A target needs at least one history item, so position 0 is never a
target. Short users (k = 1): n == 1 gives no example; n == 2 gives only a test example (position 1); n == 3
gives a test and a validation example and no training target. Why k > 1 exists: a small catalogue such as
MovieLens-100K has 943 users, so leave-one-out leaves about 200 test lists after retrieval, too few for a
confidence interval to separate two rankers (profiles/quick.yaml uses more positions; Beauty keeps k = 1).

This pure-pandas version is the reference: the Feast offline extraction must reproduce it exactly.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gr2.data.dataset import Dataset

# Consecutive events of a user are at least this far apart, so an entity timestamp of "target - 1 s"
# always lies strictly between the previous event and the target (for <= and < point-in-time joins alike).
MIN_GAP_S = 2
# Users without (complete) timestamps get synthetic times starting here (2000-01-01T00:00:00Z).
SYNTHETIC_EPOCH_S = 946_684_800

TARGET_COLUMNS = ["example_id", "user_id", "split", "target_pos", "event_ts", "history", "target"]


def event_times(interactions: pd.DataFrame) -> pd.Series:
    """Event time per interaction: datetime64[ns, UTC], strictly increasing per user in seq_idx order.

    e_i = max(t_i, e_{i-1} + 2 s) with t = the timestamp (seconds); equivalently e_i = 2 i + cummax(t_j - 2 j).
    Day-resolution ties are therefore broken by seq_idx, and a timestamp that goes backwards is lifted just
    after the previous event. A user with any missing timestamp gets synthetic times epoch + 2 s * seq_idx.
    Input must be sorted by user then seq_idx (as `load_dataset` returns it); the result aligns to its index.
    """
    seq = interactions["seq_idx"].to_numpy(np.int64)
    ts = interactions["timestamp"].to_numpy(np.float64)
    users = interactions["user_id"]
    missing = pd.Series(np.isnan(ts), index=interactions.index).groupby(users, sort=False).transform("any")
    t = np.where(missing.to_numpy(), SYNTHETIC_EPOCH_S, np.floor(np.nan_to_num(ts)))
    shifted = pd.Series(t.astype(np.int64) - MIN_GAP_S * seq, index=interactions.index)
    e = shifted.groupby(users, sort=False).cummax().to_numpy() + MIN_GAP_S * seq
    return pd.Series(pd.to_datetime(e, unit="s", utc=True), index=interactions.index, name="event_ts")


def split_labels(positions: np.ndarray, lengths: np.ndarray, eval_positions: int = 1) -> np.ndarray:
    """ "train" / "val" / "test" for each (target position, its user's length n): the one split rule, shared by the
    pandas reference, the Feast extraction and data validation."""
    k = int(eval_positions)
    if k < 1:
        raise ValueError(f"eval_positions must be >= 1, got {eval_positions}")
    pos, n = np.asarray(positions), np.asarray(lengths)
    return np.where(pos >= n - k, "test", np.where(pos >= n - 2 * k, "val", "train"))


def user_sequences(interactions: pd.DataFrame) -> dict[str, list[str]]:
    """user_id -> items in seq_idx order."""
    grouped = interactions.groupby("user_id", sort=False)["item_id"]
    return {u: list(items) for u, items in grouped}


def train_sequences(dataset: Dataset, eval_positions: int = 1) -> dict[str, list[str]]:
    """Training data of every user: positions 0..n-2k-1 (what the retriever and evidence tables are fitted on)."""
    cut = 2 * int(eval_positions)
    return {u: s[: max(len(s) - cut, 0)] for u, s in user_sequences(dataset.interactions).items()}


def build_targets(dataset: Dataset, history_len: int, eval_positions: int = 1) -> pd.DataFrame:
    """One row per (user, target position) with columns TARGET_COLUMNS, ordered by user then target_pos."""
    inter = dataset.interactions
    ets = event_times(inter).to_numpy()
    users = inter["user_id"].to_numpy()
    items = inter["item_id"].to_numpy()
    pos = inter["seq_idx"].to_numpy(np.int64)
    n = inter.groupby("user_id", sort=False)["seq_idx"].transform("size").to_numpy()
    keep = np.flatnonzero(pos >= 1)
    split = split_labels(pos, n, eval_positions)
    # Rows are sorted by user then seq_idx, so the history of row r is rows r-min(p, H)..r-1.
    histories = [list(items[r - min(int(pos[r]), history_len) : r]) for r in keep]
    out = pd.DataFrame(
        {
            "example_id": [f"{u}:{p}" for u, p in zip(users[keep], pos[keep], strict=True)],
            "user_id": users[keep],
            "split": split[keep],
            "target_pos": pos[keep],
            "event_ts": ets[keep],
            "history": histories,
            "target": items[keep],
        }
    )
    out["event_ts"] = pd.to_datetime(out["event_ts"], utc=True)
    return out.reset_index(drop=True)
