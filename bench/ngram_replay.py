"""n-gram lookup's drafts replayed, without timing them: the plain greedy output of each of
bench/speculative.py's tasks run through the engine's n-gram index (and, beside it, the rule it
replaced: the latest occurrence of the longest suffix), each step asking for the number of
drafts the engine would (engine/speculation_state.py, from the replay's own acceptance and the
verify step's cost curve measured in the same run by bench.speculative's verify_cost). Output:
per task and rule, the drafts accepted and the speed-up over plain decoding these costs imply
(tokens over the steps' summed costs: a model of the decode, exact in its tokens, which greedy
speculation does not change).

    python -m bench.ngram_replay                      # the 1.5B file, blocks as stored
    python -m bench.ngram_replay --weights int4       # requantized to our int4
    python -m bench.ngram_replay --smoke              # a tiny random model: the script runs
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from bench.common import machine, print_table
from bench.speculative import TARGET, TASKS, WEIGHTS, joined_gguf, verify_cost
from engine.speculation_state import SpeculationState
from engine.speculative.ngram import NgramIndex


class LatestIndex(NgramIndex):
    """The rule before: the latest occurrence of the longest suffix found."""

    def lookup(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        self.source = None
        return super().lookup(tokens, k)


def replay(prompt: list[int], output: list[int], index: NgramIndex, costs: list[float],
           cap: int = 8) -> tuple[float, int, int]:
    """(modelled speed-up, accepted, drafted) of n-gram drafts over `output` after `prompt`."""
    state = SpeculationState("ngram", cap)
    tokens, done, spent, accepted, drafted = list(prompt), 0, 0.0, 0, 0
    while done < len(output):
        k = min(state.next_k(lambda j: costs[j]), len(output) - done - 1, len(costs) - 1)
        index.extend(tokens, len(tokens) - 1)
        draft = index.lookup(tokens, k) if k > 0 else ()
        hits = 0
        for guess, token in zip(draft, output[done:], strict=False):
            if guess != token:
                break
            hits += 1
        if draft:
            state.record(len(draft), hits)
        spent += costs[len(draft)]
        drafted, accepted = drafted + len(draft), accepted + hits
        step = min(hits + 1, len(output) - done)
        tokens += output[done : done + step]
        done += step
    return len(output) / spent, accepted, drafted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default="as stored", help=f"one of {', '.join(WEIGHTS)}")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    from engine import LLM, SamplingParams

    if args.smoke:
        from bench.speculative import _smoke_checkpoint

        target, args.tokens, steps, options = _smoke_checkpoint(), 16, 1, {}
    else:
        target = joined_gguf(*TARGET)
        if target is None:
            raise SystemExit("the Qwen2.5-Coder-1.5B GGUF is not installed (bench/speculative.py)")
        steps, options = 9, WEIGHTS[args.weights]
    print(machine())
    costs = [ratio for _, _, _, ratio in verify_cost(target, steps, args.weights
                                                     if not args.smoke else "float32")]
    print("verify step x plain step, k = 0..8:", " ".join(f"{c:.2f}" for c in costs))
    llm = LLM(target, max_model_len=4096, **options)
    rows = []
    for task, messages in TASKS.items():
        out = llm.chat(messages, SamplingParams(max_tokens=args.tokens, temperature=0))[0]
        prompt, output = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        for name, index in (("nearest the copy", NgramIndex()), ("latest", LatestIndex())):
            speed, accepted, drafted = replay(prompt, output, index, costs)
            rows.append((task, name, len(output), f"{accepted}/{drafted}", speed))
    print_table(rows, ("task", "occurrence copied", "tokens", "accepted", "modelled x plain"))


if __name__ == "__main__":
    main()
