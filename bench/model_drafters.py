"""The drafters that run a model beside the target's own state, on random weights at real
shapes: Qwen3.5's multi-token-prediction layer (`speculative="mtp"`) and Gemma 4's assistant
(`speculative="draft:PATH"` to a Gemma4AssistantForCausalLM). Per drafter: whether greedy
output with it is plain decoding's, and per k = 1..8 what a verify step of k drafts and the
drafting of them cost against a plain decode step.

    python -m bench.model_drafters                        # both drafters
    python -m bench.model_drafters --drafters assistant   # or mtp
    python -m bench.model_drafters --smoke                # tiny random models: the script runs

Targets (bench/common.py's shapes, random weights, a bfloat16 engine): Qwen3.5-0.8B's language
model (hybrid: Gated DeltaNet and gated attention) with one MTP layer of its full-attention
layer's shape (testing/qwen3_5.py's add_mtp_weights), and Gemma 4 E4B's language model at 12 of
its 42 layers with an assistant of 4 layers (3 sliding, 1 global) at width 1024 reading E4B's
KV shapes, its 262,144-token head scored through ordered embeddings (2,048 centroids, the top
32: the config class's defaults) and, in a second row, through the whole head (the real
assistant's widths are not known here: these are ours).

Costs come from the engine's own requests, one at a time from a 200-token prompt (its prefix
cached): per k, a request asking for k drafts every step (the costs held at 0, and random drafts
are rejected, so each verify step checks k), `--tokens` tokens; its verify step's mean time
(metrics.verify_time / verify_steps) and its drafting's per step (metrics.draft_time /
verify_steps), each over the mean decode step of a request of the same round that drafts
nothing; rounds of every k in turn (`--rounds`, medians), since this machine's bandwidth drifts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import (
    build_checkpoint,
    cache_dir,
    cached_checkpoint,
    machine,
    median,
    print_table,
)

ASSISTANT = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                 num_attention_heads=8)
PROMPT_TOKENS = 200


def mtp_target(smoke: bool) -> Path:
    from testing.qwen3_5 import add_mtp_weights

    if smoke:
        from testing.qwen3_5 import build_qwen3_5_text_model

        return cached_checkpoint("mtp-smoke", "tiny Qwen3.5 with MTP", lambda p: add_mtp_weights(
            build_qwen3_5_text_model(p)))
    path = cache_dir("qwen3.5-0.8b-mtp-shapes")
    if not (path / "config.json").exists():
        import shutil

        shutil.copytree(build_checkpoint("qwen3.5-0.8b"), path)
        add_mtp_weights(path, std=0.02)
    return path


def assistant_pair(smoke: bool) -> tuple[Path, Path, Path]:
    """(target, assistant with ordered embeddings, assistant with the whole head)."""
    from testing.gemma4 import build_gemma4_assistant, build_gemma4_model

    if smoke:
        target = cached_checkpoint("gemma4-smoke", "tiny Gemma 4", lambda p: build_gemma4_model(
            p, text_only=True))
        shapes: dict = {}
    else:
        target = build_checkpoint("gemma4-e4b")
        shapes = dict(ASSISTANT, head_dim=256, global_head_dim=512, num_key_value_heads=2,
                      layer_types=["sliding_attention"] * 3 + ["full_attention"],
                      rope_parameters={"sliding_attention": {"rope_type": "default",
                                                             "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "proportional",
                                                          "rope_theta": 1e6,
                                                          "partial_rotary_factor": 0.25}})
    tag = "smoke" if smoke else "e4b"
    ordered = cached_checkpoint(f"gemma4-{tag}-assistant-ordered", "Gemma 4 assistant",
                                lambda p: build_gemma4_assistant(p, target, ordered=True,
                                                                 std=0.02, **shapes,
                                                                 **_centroids(smoke)))
    whole = cached_checkpoint(f"gemma4-{tag}-assistant", "Gemma 4 assistant",
                              lambda p: build_gemma4_assistant(p, target, std=0.02, **shapes))
    return target, ordered, whole


def _centroids(smoke: bool) -> dict:
    return {} if smoke else {"centroids": 2048, "top_centroids": 32}


def same_output(llm, prompts: list[list[int]], tokens: int) -> bool:
    """Greedy output with drafts asked for at every step equal to plain decoding's (each run
    prefilling its prompts alike: a prefix-cache hit computes the prompt's last chunk in other
    rows, whose last bits can flip a near tie of random weights)."""
    from engine import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.engine.block_manager.reset_prefix_cache()
    plain = llm.generate(inputs, SamplingParams(max_tokens=tokens, temperature=0,
                                                ignore_eos=True, num_speculative_tokens=0))
    llm.engine.block_manager.reset_prefix_cache()
    drafted = llm.generate(inputs, SamplingParams(max_tokens=tokens, temperature=0,
                                                  ignore_eos=True))
    assert sum(o.metrics.draft_tokens for o in drafted) > 0, "the drafter drafted nothing"
    return [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in drafted]


def costs(target: Path, spec: str, name: str, tokens: int, rounds: int) -> list[tuple]:
    from engine import LLM, SamplingParams

    llm = LLM(target, max_model_len=1024, dtype="bfloat16", speculative=spec,
              num_speculative_tokens=8)
    llm.engine.speculator.costs.hold(0.0)  # every step asks for its request's k drafts
    vocab = llm.engine.runner.vocab_size
    prompt = [(1000 + 7 * i) % vocab for i in range(PROMPT_TOKENS)]
    same = same_output(llm, [prompt, prompt[::-1][:60]], 24)

    def run(k: int):
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                num_speculative_tokens=k)
        return llm.generate([{"prompt_token_ids": prompt}], params)[0].metrics

    run(0)  # the prompt cached, the plans warm
    verify: dict[int, list[float]] = {k: [] for k in range(1, 9)}
    draft: dict[int, list[float]] = {k: [] for k in range(1, 9)}
    plain_ms: list[float] = []
    for _ in range(rounds):
        m0 = run(0)
        plain = m0.decode_time / (tokens - 1)
        plain_ms.append(plain * 1e3)
        for k in verify:
            m = run(k)
            steps = max(m.verify_steps, 1)
            verify[k].append(m.verify_time / steps / plain)
            draft[k].append(m.draft_time / steps / plain)
    rows = [(name, 0, median(plain_ms), 1.0, 0.0, "yes" if same else "NO")]
    rows += [(name, k, median(plain_ms) * median(verify[k]), median(verify[k]),
              median(draft[k]), "") for k in verify]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", default="mtp,assistant")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny random models, one round")
    args = parser.parse_args()
    drafters = {d.strip() for d in args.drafters.split(",") if d.strip()}
    if unknown := drafters - {"mtp", "assistant"}:
        parser.error(f"--drafters: {sorted(unknown)} not among ['assistant', 'mtp']")
    rounds = 1 if args.smoke else args.rounds
    print(machine())
    rows = []
    names = ({"mtp": "tiny Qwen3.5, MTP layer", "assistant": "tiny Gemma 4, assistant"}
             if args.smoke else {"mtp": "Qwen3.5-0.8B shapes, MTP layer",
                                 "assistant": "Gemma 4 E4B shapes, assistant"})
    if "mtp" in drafters:
        rows += costs(mtp_target(args.smoke), "mtp", names["mtp"], args.tokens, rounds)
    if "assistant" in drafters:
        target, ordered, whole = assistant_pair(args.smoke)
        rows += costs(target, f"draft:{ordered}", f"{names['assistant']} (ordered)",
                      args.tokens, rounds)
        rows += costs(target, f"draft:{whole}", f"{names['assistant']} (whole head)",
                      args.tokens, rounds)
    print_table(rows, ("drafter", "k", "step ms", "verify x plain step",
                       "drafting x plain step", "same greedy output"))


if __name__ == "__main__":
    main()
