"""Data layer: uniform-TSV datasets, MovieLens-100K fetch, TIGER split and event times."""

from gr2.data.dataset import Dataset, DatasetError, data_root, load_dataset, resolve_dataset
from gr2.data.movielens import fetch_ml100k
from gr2.data.split import build_targets, event_times, train_sequences, user_sequences

__all__ = [
    "Dataset",
    "DatasetError",
    "build_targets",
    "data_root",
    "event_times",
    "fetch_ml100k",
    "load_dataset",
    "resolve_dataset",
    "train_sequences",
    "user_sequences",
]
