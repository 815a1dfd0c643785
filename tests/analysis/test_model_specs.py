"""analysis/speed_check.py `name_dtype`: how a model argument names a dtype (`rl:bfloat16`); loading and casting
the bundles so named is tested end to end in test_local_run.py (speed_check and compare_models on a run)."""

from analysis.speed_check import name_dtype


def test_a_model_argument_may_end_in_a_dtype():
    assert name_dtype("rl") == ("rl", "float32")
    assert name_dtype("rl:bfloat16") == ("rl", "bfloat16")
    assert name_dtype("runs/x/rl/model/bundle:float32") == ("runs/x/rl/model/bundle", "float32")
    assert name_dtype("odd:name") == ("odd:name", "float32")  # not a dtype: part of the name
    assert name_dtype("rl:float16") == ("rl:float16", "float32")  # not one serving decodes in: a name
