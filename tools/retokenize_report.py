"""How often does a reply, sent back as text, tokenize to other ids than the model generated?

For each prompt, the model generates a reply (greedy or sampled); the follow-up prompt renders
that reply back as text. If ``tokenize(prompt + reply)`` is not ``prompt ids +
generated ids``, the end-of-reply state cannot match without splicing
(``cache.splice_generated``). Prints one line per prompt and a summary.

    python -m tools.retokenize_report [--model PATH] [--tokens 96]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from proxy.engine.binding import Context, ContextParams, Model
from proxy.engine.sampling import Sampler
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
}


def _render(model: Model, user: str) -> str:
    if model.chat_template():  # the synthetic ChatML models
        return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    return f"<bos><start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"


def measure(model: Model, n_tokens: int, temperature: float, seeds: int
            ) -> list[tuple[str, bool, int, str]]:
    rows = []
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
            for i in range(n_tokens):
                tok = sample(logits)
                if model.is_eog(tok):
                    break
                gen.append(tok)
                ctx.batch.clear()
                row = ctx.batch.add(0, [tok], len(ids) + i, logits_last=True)
                ctx.decode()
                logits = ctx.logits(row)
            reply = model.detokenize(gen)
            again = model.tokenize(text + reply)
            want = ids + gen
            first = next((k for k, (a, b) in enumerate(zip(again, want, strict=False))
                          if a != b), min(len(again), len(want)))
            same = again == want
            rows.append((name, same, first - len(ids) if not same else len(gen), reply))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="GGUF (default: the bundled Gemma 3 270M)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seeds", type=int, default=1, help="replies per prompt (sampled)")
    args = ap.parse_args(argv)
    if args.model is None:
        from proxy.models import default_model_path

        args.model = default_model_path()
    with Model(args.model) as model:
        rows = measure(model, args.tokens, args.temperature, args.seeds)
    bad = 0
    print(f"model {args.model.name}, replies of up to {args.tokens} tokens, "
          f"temperature {args.temperature}, top-k 40")
    print(f"{'prompt':18} {'round-trips':12} {'first diff':>10}  reply")
    for name, same, first, reply in rows:
        bad += not same
        shown = reply[:60].replace("\n", "\\n")
        print(f"{name:18} {'yes' if same else 'NO':12} {'-' if same else first:>10}  {shown}")
    print(f"{bad} of {len(rows)} replies re-tokenize to other ids")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
