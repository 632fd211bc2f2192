"""Each flag of the command line comes from its one declaration: a flag wins over its
environment variable, which wins over its default, and `--help` names both."""

from __future__ import annotations

import argparse

import pytest

from deviceplugin.flags import (
    CHECK_CONFIG_FLAGS,
    DEMO_FLAGS,
    SERVE_FLAGS,
    STATUS_FLAGS,
    Flag,
    add_flags,
)

ALL_FLAGS = (*SERVE_FLAGS, *CHECK_CONFIG_FLAGS, *DEMO_FLAGS, *STATUS_FLAGS)
WITH_ENV = [f for f in ALL_FLAGS if f.env and not f.switch]


def parse(flags: tuple[Flag, ...], argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, flags, environ)
    return parser.parse_args(argv)


def dest(flag: Flag) -> str:
    return flag.name.lstrip("-").replace("-", "_")


def some_value(flag: Flag, other_than: str = "") -> str:
    if flag.choices:
        return next(c for c in flag.choices if c != (other_than or flag.default))
    return f"/from/{dest(flag)}{'/2' if other_than else ''}"


@pytest.mark.parametrize("flag", WITH_ENV, ids=lambda f: f.name)
def test_a_flag_wins_over_its_variable_which_wins_over_its_default(flag: Flag) -> None:
    from_env = some_value(flag)
    given = some_value(flag, other_than=from_env)
    default = parse((flag,), [], {}).__dict__[dest(flag)]
    assert default == (flag.default or None if flag.choices else flag.default)
    assert parse((flag,), [], {flag.env: from_env}).__dict__[dest(flag)] == from_env
    assert parse((flag,), [], {flag.env: ""}).__dict__[dest(flag)] == default
    assert parse((flag,), [flag.name, given], {flag.env: from_env}).__dict__[dest(flag)] == given


@pytest.mark.parametrize("flag", [f for f in WITH_ENV if f.choices], ids=lambda f: f.name)
def test_a_choice_from_the_environment_is_checked_like_the_flag(
    flag: Flag, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse((flag,), [], {flag.env: "bogus"})
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert flag.name in error
    assert f"'bogus' is not one of {', '.join(flag.choices)}" in error
    assert (
        parse((flag,), [], {flag.env: flag.choices[-1].upper()}).__dict__[dest(flag)]
        == (flag.choices[-1])
    )


@pytest.mark.parametrize("flag", [f for f in ALL_FLAGS if f.switch and f.env], ids=lambda f: f.name)
def test_a_switch_is_turned_on_by_1_or_true_in_its_variable(flag: Flag) -> None:
    assert parse((flag,), [], {}).__dict__[dest(flag)] is False
    for on in ("1", "true"):
        assert parse((flag,), [], {flag.env: on}).__dict__[dest(flag)] is True
    for off in ("0", "false", "yes", ""):
        assert parse((flag,), [], {flag.env: off}).__dict__[dest(flag)] is False
    assert parse((flag,), [flag.name], {}).__dict__[dest(flag)] is True


def test_help_names_each_default_and_variable() -> None:
    parser = argparse.ArgumentParser(
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=10_000)
    )
    add_flags(parser, SERVE_FLAGS, {})
    text = parser.format_help()
    for flag in SERVE_FLAGS:
        assert f"default: {flag.shown_default()}" in text, flag.name
        assert f"env {flag.env}" in text, flag.name


def test_a_flag_given_alone_takes_its_const() -> None:
    watch = next(f for f in STATUS_FLAGS if f.name == "--watch")
    assert parse((watch,), ["--watch"], {}).watch == float(watch.const)
    assert parse((watch,), ["--watch", "0.5"], {}).watch == 0.5
    assert parse((watch,), [], {}).watch is None


def test_flag_names_and_variables_are_each_declared_once_per_command() -> None:
    for flags in (SERVE_FLAGS, CHECK_CONFIG_FLAGS, DEMO_FLAGS, STATUS_FLAGS):
        names = [f.name for f in flags]
        variables = [f.env for f in flags if f.env]
        assert len(names) == len(set(names))
        assert len(variables) == len(set(variables))
