"""Which context tokens `--mode query` should recompute: its rule (the question's attention
mass, summed over layers, heads and question tokens) against other rules at the same share,
and how close to a tie the first tokens they miss are.

A development set: Python FAQ questions that are NOT among the held-out questions of
benchmarks/approximate.py and benchmarks/query_fused.py (those stay untouched by choices made
here). Per question, at K=5, each asked cold: the full prefill's first token and greedy answer;
then each rule's teacher-forced agreement with them. Rules (all recompute the same number of
tokens, with the question's prefill, as `--mode query` does):

- mass: the shipped rule;
- last question token: only the last question token's attention (it yields the first token);
- deep / shallow layers: the mass of the second / first half of the layers;
- head max: per layer and question token, the most attentive head's weight;
- tail: the context tokens nearest the question;
- mass + predecessors: half the share by mass, each with the token before it;
- half tail: half the share nearest the question, half by mass.

The margins: the gap between the top two next-token probabilities, of the full prefill (how
near a tie the reference is) and of the probe (the question run over the concatenated cache,
before any recompute). A gate that sent low-probe-margin questions to an exact prefill would
need to gate the share of questions shown to reach the agreement shown.

    python benchmarks/query_selection.py [--questions 60] [--tokens 16] [--work DIR]

Writes benchmarks/results/query_selection.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ragkv  # noqa: E402
from benchmarks.approximate import bootstrap, interval, python_faq_with_gold  # noqa: E402
from benchmarks.fidelity import python_faq, work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import AskSettings, IngestSettings, ModelSettings  # noqa: E402
from ragkv.kv import cache as kv  # noqa: E402
from ragkv.modes import assemble, attention_probe  # noqa: E402
from ragkv.modes.blend import Recompute, _share  # noqa: E402
from ragkv.pipelines.calibrate import PLAIN, cold, teacher_forced  # noqa: E402

K = 5
RULES = (
    ("mass", 0.2),
    ("last question token", 0.2),
    ("deep layers", 0.2),
    ("shallow layers", 0.2),
    ("head max", 0.2),
    ("tail", 0.2),
    ("mass + predecessors", 0.2),
    ("half tail", 0.2),
    ("mass", 0.3),
)
GATES = (0.02, 0.05, 0.1, 0.2)


class Recorder:
    """Every layer's attention weights of the probe's question over the context, (H, Q, C)."""

    def __init__(self):
        self.layers: list[torch.Tensor] = []
        self.logits: torch.Tensor | None = None

    def attention(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out = attention_probe.sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
        probe = attention_probe._ACTIVE.get()
        if probe is not None and key.shape[2] >= probe.num_keys:
            self.layers.append(attention_probe.weights(module, query, key, probe.num_keys, scaling)[0])
            probe.mass = self.layers[-1].sum(dim=(0, 1))
        return out


def choose(rule: str, weights: torch.Tensor, count: int) -> torch.Tensor:
    """`count` positions of the (C,) context window by `rule`; weights (L, H, Q, C)."""
    mass = weights.sum(dim=(0, 1, 2))
    if rule == "mass + predecessors":
        top = mass.topk(max(1, count // 2)).indices
        picked = torch.unique(torch.cat([top, (top - 1).clamp(min=0)]))
        rest = mass.clone()
        rest[picked] = -1
        return torch.unique(torch.cat([picked, rest.topk(max(0, count - picked.numel())).indices]))[:count]
    if rule == "half tail":
        tail = torch.arange(mass.numel() - count // 2, mass.numel())
        rest = mass.clone()
        rest[tail] = -1
        return torch.unique(torch.cat([tail, rest.topk(count - tail.numel()).indices]))
    half = weights.shape[0] // 2
    score = {
        "mass": lambda: mass,
        "last question token": lambda: weights[:, :, -1].sum(dim=(0, 1)),
        "deep layers": lambda: weights[half:].sum(dim=(0, 1, 2)),
        "shallow layers": lambda: weights[:half].sum(dim=(0, 1, 2)),
        "head max": lambda: weights.amax(dim=1).sum(dim=(0, 1)),
        "tail": lambda: torch.arange(mass.numel(), dtype=torch.float),
    }[rule]()
    return score.topk(count).indices


def install(recorder: Recorder, current: dict) -> None:
    """Route `--mode query`'s choice through `choose(current["rule"], ...)`."""
    attention_probe.AttentionInterface.register(attention_probe.IMPLEMENTATION, recorder.attention)

    def attended_recompute(model, cache, context_ids, question_ids, start, ratio):
        total = len(context_ids)
        count = _share(ratio, total - start)
        if count == 0 or not question_ids:
            return None
        recorder.layers.clear()
        probe = attention_probe.Probe(total)
        question = torch.tensor([list(question_ids)], dtype=torch.long, device=model.device)
        out = attention_probe.probed_forward(
            model, probe, input_ids=question, cache=cache, use_cache=True, logits_to_keep=1
        )
        recorder.logits = out.logits[0, -1].float().clone()
        kv.crop(cache, total)
        window = torch.stack(recorder.layers)[..., start:]  # (L, H, Q, C - start)
        chosen = (choose(current["rule"], window, count) + start).sort().values
        return Recompute(chosen, torch.tensor(list(context_ids), device=model.device)[chosen], total)

    assemble.attended_recompute = attended_recompute


def margin(logits: torch.Tensor) -> float:
    top = logits.float().softmax(-1).topk(2).values
    return float(top[0] - top[1])


def run(engine, questions: list[str], tokens: int) -> list[dict]:
    recorder, current = Recorder(), {"rule": "mass"}
    install(recorder, current)
    measured = []
    for number, question in enumerate(questions, 1):
        cold(engine)
        full = engine.ask(question, top_k=K, max_new_tokens=tokens, use_cache=False, **PLAIN)
        if not full.token_ids:
            continue
        reference = teacher_forced(engine, question, AskSettings(top_k=K, use_cache=False), full.token_ids)
        row: dict = {"full_margin": margin(reference.first_logits)}
        for rule, share in RULES:
            current["rule"] = rule
            settings = AskSettings.from_dict(
                {"top_k": K, "mode": "query", "blend_ratio": share, "max_new_tokens": tokens, **PLAIN}
            )
            cold(engine)
            forced = teacher_forced(engine, question, settings, full.token_ids)
            row[(rule, share)] = (
                float(forced.first_logits.argmax() == reference.first_logits.argmax()),
                forced.agreement,
            )
            if (rule, share) == RULES[0]:
                assert recorder.logits is not None
                row["probe_margin"] = margin(recorder.logits)
        measured.append(row)
        if number % 10 == 0:
            print(f"{number}/{len(questions)} questions", file=sys.stderr, flush=True)
    return measured


def render(rows: list[dict], args, elapsed: float) -> str:
    base = RULES[0]
    lines = [
        "# `--mode query`: which tokens to recompute",
        "",
        f"Bundled SmolLM2-135M-Instruct, float32, CPU ({describe()}). {len(rows)} Python FAQ questions that are not "
        "among the held-out sets of approximate.py and query_fused.py, K=5, each asked cold; greedy without "
        f"repetition controls, {args.tokens} tokens teacher-forced. Intervals: 95% bootstrap over questions. "
        f"Command: `python benchmarks/query_selection.py --questions {args.questions} --tokens {args.tokens}` "
        f"({elapsed / 60:.0f} min).",
        "",
        "| rule | recomputed | first token = full | teacher-forced | first token: only this rule / only mass |",
        "|---|---|---|---|---|",
    ]
    for config in RULES:
        first = [r[config][0] for r in rows]
        only = sum(r[config][0] > r[base][0] for r in rows), sum(r[config][0] < r[base][0] for r in rows)
        lines.append(
            f"| {config[0]} | {config[1]:.0%} | {interval(bootstrap(first))} | "
            f"{interval(bootstrap([r[config][1] for r in rows]))} | {only[0]} / {only[1]} |"
        )
    missed = [r for r in rows if not r[base][0]]
    kept = [r for r in rows if r[base][0]]
    lines += [
        "",
        "How near a tie the first token is (top-2 probability gap), the full prefill's:",
        "",
        "| questions | count | median gap | largest gap |",
        "|---|---|---|---|",
    ]
    for name, group in (("first token missed by mass 20%", missed), ("first token kept", kept)):
        if group:
            gaps = [r["full_margin"] for r in group]
            lines.append(f"| {name} | {len(group)} | {statistics.median(gaps):.3f} | {max(gaps):.3f} |")
    lines += [
        "",
        "A gate on the probe's own top-2 gap (below it: an exact prefill; above it: mass 20%):",
        "",
        "| probe gap below | questions sent to an exact prefill | first token = full | teacher-forced |",
        "|---|---|---|---|",
    ]
    for gate in GATES:
        gated = [r["probe_margin"] < gate for r in rows]
        first = statistics.fmean(1.0 if g else r[base][0] for g, r in zip(gated, rows, strict=True))
        forced = statistics.fmean(1.0 if g else r[base][1] for g, r in zip(gated, rows, strict=True))
        lines.append(f"| {gate} | {statistics.fmean(gated):.0%} | {first:.0%} | {forced:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--work", type=Path, default=None, help="reuse downloads and stores across runs")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "query_selection.md")
    args = parser.parse_args()
    started = time.perf_counter()
    work = work_dir(args.work, "query-selection")
    faq = python_faq_with_gold(work, 45)
    if faq is None:
        sys.exit("the Python FAQ (python3.11-doc) cannot be fetched here")
    docs, held_out = faq
    _, every = python_faq(work, 1 << 20)
    held = {q for q, _ in held_out}
    development = [q for q in every if q not in held]
    random.Random(1).shuffle(development)
    store = work / "store-pyfaq"
    ragkv.ingest(
        [docs], store, model=ModelSettings(device="cpu", dtype="float32"), settings=IngestSettings(chunk_tokens=256)
    )
    with ragkv.open(store, device="cpu", write_back=False) as engine:
        engine.ask(development[0], max_new_tokens=1)  # warm up
        rows = run(engine, development[: args.questions], args.tokens)
    args.out.write_text(render(rows, args, time.perf_counter() - started))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
