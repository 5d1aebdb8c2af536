"""The shared name check behind campaign and dataset names (`infra/errors.py` `name_problem`)."""

import pytest

from paperline.infra.errors import name_problem


@pytest.mark.parametrize("name", ["a", "run-1", "v1.2_x", "0abc"])
def test_a_good_name_has_no_problem(name):
    assert name_problem(name, "campaign") is None


@pytest.mark.parametrize(("name", "said"), [
    ("my run!", "characters ' !' are not allowed: a campaign name is letters, digits, '.', '_' and '-'"),
    ("-x", "it must start with a letter or a digit: a campaign name"),
    ("", "it must start with a letter or a digit"),
    ("a/b", "characters '/' are not allowed"),
    ("{date}", "characters '{}' are not allowed"),  # no placeholder given: braces are characters
])
def test_a_bad_name_is_said_in_words(name, said):
    assert said in name_problem(name, "campaign")


@pytest.mark.parametrize("name", ["{date}", "daily-{date}", "{date}-x", "a{date}b"])
def test_the_placeholder_is_allowed_anywhere(name):
    assert name_problem(name, "dataset", placeholder="{date}") is None


@pytest.mark.parametrize(("name", "said"), [
    ("-{date}", "it must start with a letter, a digit or {date}: a dataset name"),
    ("{dat}", "characters '{}' are not allowed"),
    ("x{date}!", "characters '!' are not allowed"),
])
def test_a_bad_name_with_a_placeholder(name, said):
    assert said in name_problem(name, "dataset", placeholder="{date}")


def test_a_described_value_is_shown_in_angle_brackets_and_survives_pickling():
    """A kernel's description of what it saw (an array, a column's statistics) was quoted as if the
    user had typed it (``data['i']='min -1 (int64)'``); a typed string stays quoted."""
    import pickle

    from paperline.infra.errors import InputError
    from paperline.kernels.errors import Described, InputError as KernelInputError

    err = KernelInputError("data['i']", Described("min -1 (int64)"), "index columns must be >= 0")
    assert str(err) == "data['i']=<min -1 (int64)>: index columns must be >= 0"
    assert str(KernelInputError("routine", "gemx", "unknown")) == "routine='gemx': unknown"
    again = pickle.loads(pickle.dumps(err))  # as Dask and Prefect carry it
    assert type(again.value) is Described and str(again) == str(err)
    # re-raised by a flow with the kernel's value (paperline's InputError): still described
    assert str(InputError("data", err.value, err.problem)).startswith("data=<min -1 (int64)>: ")
    assert str(KernelInputError("a", Described("x" * 200), "p")) == f"a=<{'x' * 115}...>: p"  # cut, still closed
