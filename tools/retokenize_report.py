"""How often does a reply, sent back as text, tokenize to other ids than the model generated?

For each prompt, the model generates a reply (greedy or sampled); the follow-up prompt renders
that reply back as text, as the client got it streamed (a byte that does not finish a UTF-8
character comes back as U+FFFD). If ``tokenize(prompt + reply)`` is not ``prompt ids +
generated ids``, the end-of-reply state cannot match without splicing
(``cache.splice_generated``); the ``spliced`` column says whether splicing gets the
generated ids back. ``--cut`` ends each reply at a random length up to ``--tokens``, as a
client's ``max_tokens`` does. Prints one line per reply, a summary, and what splicing costs
the tokenizer on a long prompt.

    python -m tools.retokenize_report [--model PATH] [--tokens 96] [--cut] [--seeds 4]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from proxy.engine.binding import Context, ContextParams, Model
from proxy.engine.sampling import Sampler
from proxy.engine.splice import aligned_replies, tokenize_spliced
from proxy.engine.types import SamplingParams

# Realistic agent replies start from prompts like these (Gemma 3 turn format; the
# model continues after the generation prompt).
PROMPTS = {
    "code": "Write a Python function that parses a CSV file and returns the rows as dicts.",
    "code-indent": "Show a Python class with three methods, each with a docstring and a loop.",
    "json-tool-call": 'Call the tool read_file with the JSON arguments {"path": "src/main.py"}. '
                      "Answer only with the JSON object.",
    "json-nested": "Return a JSON object describing a user with name, age, tags and address.",
    "whitespace": "Print a table of three rows and three columns aligned with spaces.",
    "markdown": "Explain list comprehensions with a short markdown example and a bullet list.",
    "prose": "Explain in two sentences why the sky is blue.",
    "shell": "Give the shell commands to create a virtual environment and install pytest.",
    "accents": "Écris deux phrases en français sur les châteaux et les forêts.",
    "cjk": "用中文写两句话，介绍一下东京和北京。",
    "emoji": "Reply with a list of five fruits, each with its emoji.",
}


def _render(model: Model, user: str) -> str:
    if model.chat_template():  # the synthetic ChatML models
        return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    return f"<bos><start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"


def measure(model: Model, n_tokens: int, temperature: float, seeds: int, cut: bool = False
            ) -> list[tuple[str, bool, bool, int, str]]:
    """(case, round-trips, splicing recovers it, first differing token, reply) per reply."""
    rows = []
    lengths = random.Random(0)
    cases = [(f"{name}/{seed}", user, seed) for name, user in PROMPTS.items()
             for seed in range(seeds)]
    with Context(model, ContextParams(n_ctx=2048, n_seq_max=1)) as ctx:
        for name, user, seed in cases:
            sample = Sampler(SamplingParams(temperature=temperature, top_k=40, seed=seed))
            ctx.clear_lane(0)
            text = _render(model, user)
            ids = model.tokenize(text)
            logits = ctx.prefill(0, ids, 0)
            assert logits is not None
            gen: list[int] = []
            limit = lengths.randint(1, n_tokens) if cut else n_tokens
            for i in range(limit):
                tok = sample(logits)
                if model.is_eog(tok):
                    break
                gen.append(tok)
                ctx.batch.clear()
                row = ctx.batch.add(0, [tok], len(ids) + i, logits_last=True)
                ctx.decode()
                logits = ctx.logits(row)
            reply = model.detokenize(gen)  # as streamed: U+FFFD for a cut character
            again = model.tokenize(text + reply)
            want = ids + gen
            first = next((k for k, (a, b) in enumerate(zip(again, want, strict=False))
                          if a != b), min(len(again), len(want)))
            same = again == want
            pieces = [model.token_bytes(t) for t in gen]
            replies = aligned_replies(gen, pieces, [False] * len(gen))
            spliced, _ = tokenize_spliced(text + reply, model.tokenize, replies)
            rows.append((name, same, spliced == want,
                         first - len(ids) if not same else len(gen), reply))
    return rows


def splice_cost(model: Model, replies: int = 32, repeat: int = 5) -> tuple[float, float, int]:
    """Tokenizing a long prompt that holds ``replies`` earlier replies: (ms without
    splicing, ms with, tokens), the median of ``repeat`` runs."""
    text_parts: list[str] = []
    memory = []
    for k in range(replies):
        reply = f"Reply {k}: " + " ".join(f"step {k}.{i} done;" for i in range(60))
        ids = model.tokenize(reply)
        memory += aligned_replies(ids, [model.token_bytes(t) for t in ids], [False] * len(ids))
        text_parts += [f"<start_of_turn>user\nTurn {k}, go on.<end_of_turn>\n",
                       f"<start_of_turn>model\n{reply}<end_of_turn>\n"]
    text = "".join(text_parts)

    def median_ms(fn: object) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            times.append(1000 * (time.perf_counter() - t0))
        return sorted(times)[len(times) // 2]

    plain = median_ms(lambda: model.tokenize(text))
    spliced = median_ms(lambda: tokenize_spliced(text, model.tokenize, memory))
    return plain, spliced, len(model.tokenize(text))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="GGUF (default: the bundled Gemma 3 270M)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seeds", type=int, default=1, help="replies per prompt (sampled)")
    ap.add_argument("--cut", action="store_true",
                    help="end each reply at a random length up to --tokens (max_tokens)")
    args = ap.parse_args(argv)
    if args.model is None:
        from proxy.models import default_model_path

        args.model = default_model_path()
    with Model(args.model) as model:
        rows = measure(model, args.tokens, args.temperature, args.seeds, args.cut)
        cost = splice_cost(model)
    bad = fixed = 0
    print(f"model {args.model.name}, replies of up to {args.tokens} tokens"
          f"{' cut at random lengths' if args.cut else ''}, temperature {args.temperature}, "
          "top-k 40")
    print(f"{'prompt':18} {'round-trips':12} {'spliced':8} {'first diff':>10}  reply")
    for name, same, spliced, first, reply in rows:
        bad += not same
        fixed += spliced and not same
        shown = reply[:60].replace("\n", "\\n")
        print(f"{name:18} {'yes' if same else 'NO':12} {'yes' if spliced else 'NO':8} "
              f"{'-' if same else first:>10}  {shown}")
    print(f"{bad} of {len(rows)} replies re-tokenize to other ids; splicing gets the "
          f"generated ids back for {fixed} of them")
    print(f"tokenizing a {cost[2]:,}-token prompt holding 32 earlier replies: "
          f"{cost[0]:.1f} ms, {cost[1]:.1f} ms with splicing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
