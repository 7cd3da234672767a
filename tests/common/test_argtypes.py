"""The numbers our CLIs take are checked where they are parsed: one line, exit code 2."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadgen.cli import build_parser as loadgen_parser
from loadgen.cli import main as loadgen_main
from services.cli import build_parser as megha_parser
from services.common.argtypes import (
    bounded,
    env_pair,
    fraction,
    non_negative_float,
    non_negative_int,
    number_list,
    port,
    positive_float,
    positive_int,
)


@pytest.mark.parametrize(
    ("kind", "text", "value"),
    [
        (positive_int, "3", 3),
        (non_negative_int, "0", 0),
        (positive_float, "0.25", 0.25),
        (non_negative_float, "0", 0.0),
        (fraction, "0.999", 0.999),
        (port, "65535", 65535),
        (number_list(positive_int), "1, 2,3,", (1, 2, 3)),
    ],
)
def test_values_in_range_pass(kind, text, value):
    assert kind(text) == value


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        (positive_int, "0", "must be > 0, got 0"),
        (positive_int, "1.5", "expected an integer, got '1.5'"),
        (non_negative_int, "-1", "must be >= 0, got -1"),
        (positive_float, "nan", "expected a finite number, got 'nan'"),
        (non_negative_float, "inf", "expected a finite number, got 'inf'"),
        (non_negative_float, "x", "expected a number, got 'x'"),
        (fraction, "1", "must be > 0 and < 1, got 1"),
        (fraction, "0", "must be > 0 and < 1, got 0"),
        (port, "0", "must be >= 1 and <= 65535, got 0"),
        (bounded(float, "rate", 0, high=100_000), "1e6", "<= 100000"),
        (number_list(fraction), "0.1,2", "must be > 0 and < 1, got 2"),
        (number_list(fraction), ",", "expected comma-separated numbers, got ','"),
    ],
)
def test_values_out_of_range_are_refused_with_the_reason(kind, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("+", r"\+")):
        kind(text)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_fraction_is_exactly_the_finite_numbers_strictly_between_0_and_1(x):
    try:
        value = fraction(repr(x))
    except argparse.ArgumentTypeError:
        assert not 0 < x < 1
    else:
        assert 0 < value < 1 and value == x


def test_an_environment_pair_is_a_name_an_equals_sign_and_any_value():
    assert env_pair("FOO=bar") == ("FOO", "bar")
    assert env_pair("_X1=") == ("_X1", "")
    assert env_pair("URL=a=b") == ("URL", "a=b")
    for text in ("FOO", "=bar", "1X=y", "A-B=c", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=VALUE"):
            env_pair(text)


def _numeric_options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(subcommand path, action) for every option that parses its value into a number."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _numeric_options(sub, (*path, name))
        elif action.option_strings and action.type not in (None, str, Path, env_pair):
            yield path, action


NUMERIC = [
    pytest.param(action, id=" ".join((prog, *path, action.option_strings[-1])))
    for prog, parser in (("megha", megha_parser()), ("megha-loadgen", loadgen_parser()))
    for path, action in _numeric_options(parser)
]


def test_every_cli_has_numeric_options_to_check():
    assert len(NUMERIC) > 60


# Options whose negative values mean something: a priority below the default 0.
SIGNED = {"--priority"}


@pytest.mark.parametrize("action", NUMERIC)
def test_every_numeric_option_refuses_negative_and_non_finite_values(action):
    """No option takes -5, nan or inf: each would crash a run or make it meaningless
    (``vm-sim --hosts -5`` was a numpy traceback, ``--repredict-minutes -5`` never ended)."""
    signed = action.option_strings[-1] in SIGNED
    for text in ("nan", "inf", "many", *(() if signed else ("-5",))):
        with pytest.raises(argparse.ArgumentTypeError):
            action.type(text)
    if signed:
        assert action.type("-5") == -5
        with pytest.raises(argparse.ArgumentTypeError):
            action.type(str(-(2**31) - 1))  # an int32 on the wire


@pytest.mark.parametrize("action", NUMERIC)
def test_every_numeric_default_is_a_value_its_option_accepts(action):
    default = action.default
    if default is None or isinstance(default, str) or default == ():
        return  # nothing given: the option's value is not parsed
    values = list(default) if isinstance(default, list | tuple) else [default]
    if action.nargs is None:
        values = [",".join(map(str, values))] if isinstance(default, tuple) else values
    for value in values:
        action.type(str(value))


def test_a_bad_number_stops_vm_sim_before_it_runs(capsys):
    with pytest.raises(SystemExit) as stop:
        loadgen_main(["vm-sim", "--hosts", "-3"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument --hosts: must be >= 0, got -3" in err and "Traceback" not in err


def test_vm_sim_explains_a_file_that_is_not_a_model(tmp_path, capsys):
    bogus = tmp_path / "model.pkl"
    bogus.write_text("not a model\n")
    assert loadgen_main(["vm-sim", "--vms", "50", "--model", str(bogus)]) == 2
    assert f"{bogus} is not a lifetime model" in capsys.readouterr().err
