"""The offline API as a vLLM user calls it: SamplingParams' optional fields and the prompt forms
LLM.generate takes."""
import pytest

from mini_engine import SamplingParams


def test_stop_and_stop_token_ids_of_none_mean_none():
    """vLLM's defaults for both are None, so callers pass None through; it meant a TypeError
    ('NoneType' object is not iterable) here."""
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == [] and params.stop_token_ids == []


def test_stop_token_ids_from_a_generator_are_kept():
    """Validation iterated the argument before copying it: a generator was used up, and the
    request silently had no stop tokens."""
    assert SamplingParams(stop_token_ids=(t for t in [5, 6])).stop_token_ids == [5, 6]


@pytest.mark.parametrize("kwargs, match", [(dict(stop=5), "stop"), (dict(stop_token_ids=5), "stop_token_ids")])
def test_a_stop_that_is_not_a_list_is_a_value_error_naming_it(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
