"""`python app.py --backend`: options, environment variables and start-up failures, against a
stand-in server on 127.0.0.1."""

from __future__ import annotations

import logging

import pytest

import app
from launch.engines import is_local, load_engines
from launch.options import engine_options, parse_args
from tests.api_fixtures import running_server
from tests.vllm_standin import MODEL, StandIn


@pytest.fixture(scope="module")
def url():
    with running_server(StandIn().app()) as base:
        yield f"{base}/v1"


def test_the_backend_comes_from_the_flag_or_the_environment(url, monkeypatch):
    args = parse_args(["--backend", url, "--backend-key", "k"])
    assert (args.backend, args.backend_key) == (url, "k")
    monkeypatch.setenv("MMSERVE_BACKEND", url)
    monkeypatch.setenv("MMSERVE_BACKEND_KEY", "secret")
    args = parse_args([])
    assert (args.backend, args.backend_key) == (url, "secret")
    engines, notes = load_engines(args)
    assert list(engines) == [MODEL] and notes == {}
    assert engines[MODEL].config.api_key == "secret" and not is_local(engines)


@pytest.mark.parametrize("flags", [["--device", "cuda"], ["--max-num-seqs", "4"], ["--api-only"],
                                   ["--api-key", "k"], ["--no-prefix-caching"],
                                   ["--quantization", "int8"]])
def test_engine_options_are_refused_with_a_backend(flags, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--backend", "http://127.0.0.1:1/v1", *flags])
    assert f"{flags[0]} apply to engines loaded here, not with --backend" in capsys.readouterr().err


def test_models_are_picked_by_name(url, monkeypatch):
    engines, _ = load_engines(parse_args(["--backend", url, "--model", MODEL]))
    assert list(engines) == [MODEL]
    monkeypatch.setenv("MODEL", "some/other-model")
    with pytest.raises(ValueError, match=f"does not serve 'some/other-model'; it serves: {MODEL}"):
        load_engines(parse_args(["--backend", url]))


def test_an_unreachable_backend_stops_the_app_with_a_plain_message(caplog):
    with caplog.at_level(logging.ERROR, logger="mmserve"):
        assert app.main(["--backend", "http://127.0.0.1:1/v1"]) == 2
    assert "could not connect to the server at http://127.0.0.1:1/v1" in caplog.text


def test_quantization_flags_become_engine_options():
    args = parse_args(["--quantization", "int4", "--quantization-group-size", "64"])
    assert engine_options(args) == {"quantization": "int4", "quantization_group_size": 64}
    assert "quantization" not in engine_options(parse_args([]))


def test_kv_cache_dtype_flag_becomes_an_engine_option():
    args = parse_args(["--kv-cache-dtype", "int8"])
    assert engine_options(args) == {"kv_cache_dtype": "int8"}


def test_help_lists_every_flag_without_loading_torch_or_gradio():
    """`python app.py --help` answers at once: the entry point and launch/ import neither
    torch nor gradio before the options are read."""
    import subprocess
    import sys
    from pathlib import Path

    from launch.options import ENGINE_OPTIONS

    script = ("import sys\nsys.modules['torch'] = sys.modules['gradio'] = None\n"
              "import runpy\nsys.argv = ['app.py', '--help']\n"
              "runpy.run_path('app.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    flags = [*ENGINE_OPTIONS, "--model", "--mmproj", "--no-model-stores", "--backend",
             "--backend-key", "--backend-timeout", "--backend-max-body-mb",
             "--backend-no-token-ids", "--device", "--dtype", "--host", "--port", "--share",
             "--api-key", "--allowed-origins", "--api-only", "--transcription-model",
             "--no-prefix-caching", "--dequantize-gguf", "--lora"]
    assert [f for f in flags if f not in done.stdout] == []
