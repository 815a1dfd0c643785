"""Fixtures shared by the tests of gr2/."""

from __future__ import annotations

import pytest
import torch

from tests.gr2.toys import toy_sft_and_cft
from tests.gr2.trace_toy import BS, trace_items


@pytest.fixture(scope="session")
def trace_models(tmp_path_factory):
    """AR and block-diffusion models trained on `trace_items`: they copy the trace, then answer at random."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield toy_sft_and_cft(trace_items(512, 10), BS, 200, tmp_path_factory)
    torch.set_num_threads(n)
