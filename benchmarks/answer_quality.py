"""Do answers read well? The share of answers that repeat themselves, before and after the
decoding defaults, on the bundled SmolLM2 (float32, CPU).

An answer "loops" when it contains a repeated 8-gram of words. Also reported: how many
answers hit max_new_tokens, mean answer length, and how much of each answer's vocabulary
comes from its retrieved context (a rough faithfulness signal: content words of the answer
found in the context). Corpora: the sample corpus in data/ with benchmarks/questions.txt,
and the Python FAQ (Debian's python3.11-doc, fetched at run time) with its own questions.

    python benchmarks/answer_quality.py [--faq-questions 10] [--faq-pages general.html,...] [--work DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.fidelity import python_faq, work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import IngestSettings, ModelSettings  # noqa: E402

# (label, ask options): the first is the old behaviour, the last the new defaults.
VARIANTS = [
    (
        "before: greedy, no repetition control, 256 tokens (the old defaults)",
        dict(max_new_tokens=256, repetition_penalty=1.0, no_repeat_ngram=0),
    ),
    ("after (defaults): penalty 1.1 + no-repeat 6-grams, 128 tokens", dict()),
]
# The system prompts tried for the bundled model (each a store of its own), with the defaults.
SYSTEM_PROMPTS = {
    "before": "You are a helpful assistant. Answer the question using only the context provided. "
    "If the context does not contain the answer, say so.",
    "after (default)": None,
}
WORD = re.compile(r"\w+", re.UNICODE)
STOPWORDS = set(
    "the a an and or of to in on for is are be it this that with as by at from you your can if not "
    "do does i we they he she its was were will would should has have had".split()
)


def repeats_8gram(text: str) -> bool:
    words = [w.lower() for w in WORD.findall(text)]
    grams = [tuple(words[i : i + 8]) for i in range(len(words) - 7)]
    return len(grams) != len(set(grams))


def grounded(answer: str, context: str) -> float:
    words = {w.lower() for w in WORD.findall(answer)} - STOPWORDS
    if not words:
        return 0.0
    seen = {w.lower() for w in WORD.findall(context)}
    return len(words & seen) / len(words)


def evaluate(engine, questions: list[str], variants=VARIANTS) -> list[dict]:
    rows = []
    for label, options in variants:
        loops = length_cut = tokens = 0
        grounding = []
        for question in questions:
            answer = engine.ask(question, **options)
            loops += repeats_8gram(answer.text)
            length_cut += answer.stats.finish_reason == "length"
            tokens += len(answer.token_ids)
            context = " ".join(row.text for row, _ in engine.retrieve(question, 1))
            grounding.append(grounded(answer.text, context))
        n = len(questions)
        rows.append(
            {
                "label": label,
                "n": n,
                "loops": loops / n,
                "length": length_cut / n,
                "tokens": tokens / n,
                "grounded": sum(grounding) / n,
            }
        )
        print(rows[-1], flush=True)
    return rows


def render(results: dict, examples: list[tuple[str, str, str]], prompts: list[dict]) -> str:
    lines = [
        "# Answer quality: repetition before and after the decoding defaults",
        "",
        f"Bundled SmolLM2-135M-Instruct, float32, top-1 chunk, on {describe()}. "
        "Command: `python benchmarks/answer_quality.py`.",
        "",
        "loops: answers containing a repeated 8-gram of words. cut: answers that hit max_new_tokens. "
        "grounded: mean share of an answer's content words found in its retrieved chunk.",
        "",
    ]
    for name, rows in results.items():
        lines += [
            f"## {name}: {rows[0]['n']} questions",
            "",
            "| decoding | loops | cut | mean tokens | grounded |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['label']} | {r['loops']:.0%} | {r['length']:.0%} | {r['tokens']:.0f} | {r['grounded']:.2f} |"
            for r in rows
        ]
        lines.append("")
    lines += [
        "## System prompt (sample corpus, default decoding)",
        "",
        "| system prompt | loops | grounded | mean tokens | answer to the demo question |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f'| {p["label"]}: "{p["prompt"]}" | {p["loops"]:.0%} | {p["grounded"]:.2f} | {p["tokens"]:.0f} | '
        f"{p['demo'][:160].replace(chr(10), ' ')}... |"
        for p in prompts
    ]
    lines += ["", "## The demo question", ""]
    for label, question, text in examples:
        lines += [f'{label}, "{question}":', "", "> " + text.replace("\n", "\n> "), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faq-questions", type=int, default=10)
    parser.add_argument(
        "--faq-pages",
        default="general.html,gui.html,installed.html,windows.html",
        help="which FAQ pages to ingest (all: '')",
    )
    parser.add_argument("--work", type=Path, default=None, help="reuse stores and downloads across runs")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "answer_quality.md")
    args = parser.parse_args()
    work = work_dir(args.work, "quality")
    questions = (ROOT / "benchmarks" / "questions.txt").read_text().splitlines()
    corpora = {"sample corpus (data/)": (ROOT / "data", questions)}
    if faq := python_faq(work, args.faq_questions, tuple(p for p in args.faq_pages.split(",") if p)):
        corpora[f"Python FAQ (python3.11-doc: {args.faq_pages or 'all pages'})"] = faq
    results, examples = {}, []
    for name, (docs, qs) in corpora.items():
        store = work / re.sub(r"\W+", "-", name)
        ragkv.ingest([docs], store, model=ModelSettings(device="cpu", dtype="float32"))
        with ragkv.open(store, device="cpu") as engine:
            results[name] = evaluate(engine, qs)
            if not examples:
                for label, options in (VARIANTS[0], VARIANTS[-1]):
                    examples.append((label, qs[0], engine.ask(qs[0], **options).text))
    prompts = []
    for label, prompt in SYSTEM_PROMPTS.items():
        store = work / f"prompt-{label.split()[0]}"
        settings = IngestSettings(system_prompt=prompt) if prompt else IngestSettings()
        ragkv.ingest([ROOT / "data"], store, model=ModelSettings(device="cpu", dtype="float32"), settings=settings)
        with ragkv.open(store, device="cpu") as engine:
            (row,) = evaluate(engine, questions, [(label, {})])
            prompts.append({**row, "prompt": settings.system_prompt, "demo": engine.ask(questions[0]).text})
    args.out.write_text(render(results, examples, prompts))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
