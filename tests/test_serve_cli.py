"""`python -m sdx.serve`'s flags: a bad one is one `error:` line and exit status 2, before anything loads."""

from __future__ import annotations

import pytest

from serve import cli, server

BAD = [
    (["--port", "70000"], "error: --port 70000: a TCP port, 0 to 65535"),
    (["--api-auth", "alice"], "error: --api-auth 'alice': give user:password pairs separated by commas"),
    (["--api-auth", "alice:x,:y"], "error: --api-auth 'alice:x,:y': give user:password pairs separated by commas"),
    (["--queue-size", "0"], "error: --queue-size 0 must be a positive integer"),
    (["--max-pixels", "-1"], "error: --max-pixels -1 must be a positive integer"),
    (["--max-body-mb", "0"], "error: --max-body-mb 0.0 must be a positive number"),
    (["--batch-wait-ms", "-5"], "error: --batch-wait-ms -5.0 must be a positive number"),
    (["--cors-allow-origins", " , "], "error: --cors-allow-origins: give one or more origins, separated by commas"),
    (["--warmup", "0x64"], "error: --warmup 0x64: sizes are positive"),
    (["--warmup", "big"], "error: argument --warmup: 'big' is not HEIGHTxWIDTH, e.g. 1024x1024"),
    (["--fsdp", "0"], "error: --fsdp 0 must be a positive integer"),
    (["--dtype", "float8"], "error: argument --dtype: invalid choice: 'float8'"),
    (["--steps", "4"], "error: unrecognized arguments: --steps 4"),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_flag_is_one_error_line_before_anything_loads(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(server, "load", lambda *_: pytest.fail("the model was loaded"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(words) and err.count("\n") == 1, err


def test_the_settings_of_good_flags():
    args = cli.parser().parse_args(["--listen", "--port", "7861", "--api-auth", "a:b:c,d:e", "--cors-allow-origins",
                                    "http://x:3000, http://y", "--warmup", "64x64", "1024x768"])
    settings = cli.check(args)
    assert (settings.host, settings.port) == ("0.0.0.0", 7861)
    assert settings.users == (("a", "b:c"), ("d", "e"))
    assert settings.cors_origins == ("http://x:3000", "http://y") and settings.warmup == ((64, 64), (1024, 768))
    assert cli.check(cli.parser().parse_args([])).host == "127.0.0.1"  # this machine only, unless --listen
