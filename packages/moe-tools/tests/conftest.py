"""Fixtures shared by the command-line tests."""

from __future__ import annotations

import pytest

from moe_tools import cli


@pytest.fixture
def refused(capsys):
    """``refused(argv, *words)``: ``moe-bench argv`` exits with status 2 and one line on stderr
    naming each of ``words``, no traceback; returns that line."""

    def check(argv: list[str], *words: str) -> str:
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse's errors
            code = exc.code
        err = capsys.readouterr().err.strip()
        assert code == 2, (argv, code, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        for word in words:
            assert word in err, (word, err)
        return err

    return check
