"""The CLI's value parsers (speccal/cli/parse.py): one rule for ``--request-buckets`` in
``bench`` and ``calibrate``, one for acceptance profiles in ``trace``, ``generate`` and
``bench`` (commas and / or spaces separate values)."""

from __future__ import annotations

import pytest

from speccal.base.errors import InputError
from speccal.cli import parse


@pytest.mark.parametrize("text", ["1,2,4", "1 2 4", "1, 2, 4", " 1,2 4 "])
def test_buckets_split_on_commas_and_spaces(text):
    assert parse.calibrate_buckets(text) == (1, 2, 4)
    assert parse.bench_buckets(text) == (1, 2, 4)


def test_two_spaced_buckets_are_two_buckets_not_twelve():
    assert parse.calibrate_buckets("1 2") == (1, 2)


def test_empty_buckets():
    assert parse.bench_buckets(None) is None and parse.bench_buckets("") is None
    assert parse.calibrate_buckets(None) is None
    for text in ("", ",", " , "):
        with pytest.raises(InputError, match="at least one bucket"):
            parse.calibrate_buckets(text)


@pytest.mark.parametrize("text", ["a,b", "1,x", "1.5"])
def test_bad_buckets_name_the_flag(text):
    for fn in (parse.calibrate_buckets, parse.bench_buckets):
        with pytest.raises(InputError, match=r"--request-buckets.*integers separated by commas"):
            fn(text)


@pytest.mark.parametrize("text", ["0.5,0.25", "0.5 0.25", "0.5, 0.25"])
def test_profiles_split_on_commas_and_spaces(text):
    assert parse.floats(text, "--acceptance-profile") == (0.5, 0.25)


def test_a_bad_profile_names_the_flag():
    with pytest.raises(InputError, match=r"--acceptance-profile.*probabilities"):
        parse.floats("0.5,x", "--acceptance-profile")
