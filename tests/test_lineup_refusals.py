"""One model's refusal does not stop the lineup: with a batch budget that the demo's Gemma 4
refuses (its images are attended both ways, in one chunk), `python app.py` serves every other
demo model and the picker lists Gemma 4 with the reason it did not start."""

from __future__ import annotations

import asyncio

import pytest

from launch.engines import REFUSED, load_engines, refused_models, shutdown
from launch.options import parse_args
from tests.ui_fixtures import demo_root
from ui import demo
from ui.lineup import Lineup

SERVED = ("demo-qwen2-vl", "demo-gemma4")  # of the lineup: one that starts, the one that cannot


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MMSERVE_DEMO_DIR", str(demo_root(tmp_path_factory)))
    mp.setattr(demo, "DEMO_LINEUP", tuple(m for m in demo.DEMO_LINEUP if m.name in SERVED))
    mp.setattr(demo, "real_models", dict)
    args = parse_args(["--max-num-batched-tokens", "64", "--kv-cache-bytes", str(16 << 20),
                           "--max-num-seqs", "4"])
    engines, notes = load_engines(args)
    try:
        yield engines, notes
    finally:
        shutdown(engines)
        mp.undo()


def test_the_others_are_served_and_the_refused_one_says_why(started):
    engines, notes = started
    assert "demo-gemma4" not in engines and "demo-qwen2-vl" in engines
    reason = notes["demo-gemma4"].removeprefix(REFUSED)
    assert notes["demo-gemma4"].startswith(REFUSED) and "max_num_batched_tokens" in reason
    lineup = Lineup(dict(engines), refused_models(engines, notes))
    labels = dict((name, label) for label, name in lineup.choices())
    assert labels["demo-gemma4"].startswith("demo-gemma4 (not started: ")
    assert labels["demo-qwen2-vl"] == "demo-qwen2-vl"
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        asyncio.run(lineup.load("demo-gemma4"))


def test_a_single_model_that_refuses_still_stops_the_app(tmp_path, qwen2_path):
    args = parse_args(["--model", str(qwen2_path), "--max-model-len", "0"])
    with pytest.raises(ValueError):
        load_engines(args)
