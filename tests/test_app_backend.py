"""`python app.py --backend`: options, environment variables and start-up failures, against a
stand-in server on 127.0.0.1."""

from __future__ import annotations

import logging

import pytest

import app
from tests.api_fixtures import running_server
from tests.vllm_standin import MODEL, StandIn


@pytest.fixture(scope="module")
def url():
    with running_server(StandIn().app()) as base:
        yield f"{base}/v1"


def test_the_backend_comes_from_the_flag_or_the_environment(url, monkeypatch):
    args = app.parse_args(["--backend", url, "--backend-key", "k"])
    assert (args.backend, args.backend_key) == (url, "k")
    monkeypatch.setenv("MMSERVE_BACKEND", url)
    monkeypatch.setenv("MMSERVE_BACKEND_KEY", "secret")
    args = app.parse_args([])
    assert (args.backend, args.backend_key) == (url, "secret")
    engines, notes = app.load_engines(args)
    assert list(engines) == [MODEL] and notes == {}
    assert engines[MODEL].config.api_key == "secret" and not app.is_local(engines)


@pytest.mark.parametrize("flags", [["--device", "cuda"], ["--max-num-seqs", "4"], ["--api-only"],
                                   ["--api-key", "k"], ["--no-prefix-caching"],
                                   ["--quantization", "int8"]])
def test_engine_options_are_refused_with_a_backend(flags, capsys):
    with pytest.raises(SystemExit):
        app.parse_args(["--backend", "http://127.0.0.1:1/v1", *flags])
    assert f"{flags[0]} apply to engines loaded here, not with --backend" in capsys.readouterr().err


def test_models_are_picked_by_name(url, monkeypatch):
    engines, _ = app.load_engines(app.parse_args(["--backend", url, "--model", MODEL]))
    assert list(engines) == [MODEL]
    monkeypatch.setenv("MODEL", "some/other-model")
    with pytest.raises(ValueError, match=f"does not serve 'some/other-model'; it serves: {MODEL}"):
        app.load_engines(app.parse_args(["--backend", url]))


def test_an_unreachable_backend_stops_the_app_with_a_plain_message(caplog):
    with caplog.at_level(logging.ERROR, logger="mmserve"):
        assert app.main(["--backend", "http://127.0.0.1:1/v1"]) == 2
    assert "could not connect to the server at http://127.0.0.1:1/v1" in caplog.text


def test_quantization_flags_become_engine_options():
    args = app.parse_args(["--quantization", "int4", "--quantization-group-size", "64"])
    assert app.engine_options(args) == {"quantization": "int4", "quantization_group_size": 64}
    assert "quantization" not in app.engine_options(app.parse_args([]))


def test_kv_cache_dtype_flag_becomes_an_engine_option():
    args = app.parse_args(["--kv-cache-dtype", "int8"])
    assert app.engine_options(args) == {"kv_cache_dtype": "int8"}
