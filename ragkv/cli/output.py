"""What the `ragkv` command prints and writes: each report as the lines a person reads (the
`--json` form is the report's own `to_dict`), and the files a user names (`--out`,
`--report`). Functions return lines; the command prints them."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from ragkv.core.errors import InputError, OutputError


class OutputFile:
    """A file the user asked for, checked when named (before any model loads); a failed write
    (disk full, permissions) is an OutputError naming it."""

    def __init__(self, path: Path, what: str):
        if path.is_dir():
            raise InputError(f"{what} {path} is a folder; name a file to write")
        if not path.parent.is_dir():
            raise InputError(f"{what} {path}: the folder {path.parent} does not exist")
        self.path, self.what = path, what
        self._file: TextIO | None = None  # open between __enter__ and __exit__

    def __enter__(self):
        self._file = self._call(open, self.path, "w", encoding="utf-8")
        return self

    def write(self, text: str) -> None:
        assert self._file is not None, "write inside `with`"
        self._call(self._file.write, text)

    def __exit__(self, *exc):
        if self._file is not None:
            self._call(self._file.close)

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            raise OutputError(f"cannot write {self.what} {self.path}: {exc.strerror or exc}") from None


def format_bytes(size: float) -> str:
    """As the budget writes sizes (20.0 GB); imported here so that `ragkv --help` loads no store code."""
    from ragkv.store.kv.budget import format_bytes as in_units

    return in_units(size)


def mib(size: float) -> str:
    return f"{size / 2**20:.1f} MiB"


def ingest_lines(report: dict) -> list[str]:
    docs = report["documents"]
    lines = [
        f"Store {report['store']} (generation {report['generation']}): {docs['added']} added, "
        f"{docs['changed']} changed, {docs['unchanged']} unchanged, {docs['removed']} removed documents"
    ]
    adopted = f", {report['kv_adopted']} recovered from an interrupted run" if report["kv_adopted"] else ""
    if report["kv_deferred"] or report["kv_evicted"] or report["kv_budget"] is not None:
        budget = f" of a {format_bytes(report['kv_budget'])} budget" if report["kv_budget"] is not None else ""
        adopted += (
            f"; {report['kv_deferred']} chunks left to compute on their first question, "
            f"{report['kv_evicted']} evicted; KV takes {format_bytes(report['kv_bytes'])}{budget}"
        )
    engine = {"ray": " (Ray)", "vllm": " (vLLM)"}.get(report.get("engine") or "", "")
    lines.append(
        f"KV: {report['kv_computed']} chunks computed ({report['tokens_computed']:,} tokens, "
        f"{report['tokens_per_s']:,.0f} tokens/s), {report['kv_reused']} already stored "
        f"({report['tokens_skipped']:,} tokens skipped){adopted}; {report['model']} {report['dtype']} on "
        f"{report['device']}{engine}; {report['total_s']:.1f} s"
    )
    if report.get("calibration"):
        lines.append(f"--mode approximate: {report['calibration']}")
    if report["skipped"]:
        lines.append(f"Skipped {len(report['skipped'])} file(s):")
        lines += [f"  {item['source']}: {item['reason']}" for item in report["skipped"]]
    return lines


def gc_lines(report: dict) -> list[str]:
    held = report["generations_kept_for_readers"]
    return [
        f"gc: {report['entries_removed']} KV entries removed, {report['shards_rewritten']} shards rewritten, "
        f"{report['shards_deleted']} shard files deleted, {mib(report['bytes_reclaimed'])} reclaimed"
        + (f"; generations {held} kept for readers that still use them" if held else "")
        + ("; catalog compacted" if report.get("catalog_compacted") else "")
        + ("; vector segments compacted" if report.get("vectors_compacted") else "")
    ]


def fold_lines(report: dict) -> list[str]:
    return [
        f"fold: {report['objects']} pending objects ({report['entries']} KV entries): {report['stored']} stored, "
        f"{report['uses_folded']} uses folded; generation {report['generation']}"
        + (f"; {report['damaged']} damaged objects deleted" if report["damaged"] else "")
        + (f"; {report['incomplete']} incomplete objects deleted" if report["incomplete"] else "")
    ]


def verify_lines(report: dict) -> list[str]:
    lines = [
        f"verify: generation {report['generation']}, {report['entries_checked']} entries "
        f"({mib(report['bytes_checked'])}) checked in {report['seconds']:.2f} s: "
        + ("ok" if report["ok"] else f"{len(report['problems'])} problems")
    ]
    lines += [f"  {problem['kind']}: {problem['detail']}" for problem in report["problems"]]
    return lines + [f"  warning: {warning}" for warning in report.get("warnings", [])]


def repair_lines(fixed) -> list[str]:
    lines = [
        f"repair: {fixed.problems_found} problems, {fixed.entries_recomputed} entries recomputed, "
        f"{fixed.entries_dropped} unused entries dropped, {fixed.chunks_reembedded} chunks re-embedded, "
        f"{fixed.lexical_rebuilt} lexical files rebuilt"
    ]
    if fixed.current_restored is not None:
        lines.append(f"  CURRENT pointed at no complete generation: it now names {fixed.current_restored}")
    return lines + [f"  cannot repair: {reason}" for reason in fixed.unrepairable]


def place(citation: str, doc_id: str) -> str:
    """A citation's pages and section (" p. 3, § Security"), to follow a source's path."""
    where = citation.removeprefix(doc_id).lstrip(", ")
    return f" {where}" if where else ""


def source_line(s) -> str:
    return f"{s.source}{place(s.citation, s.doc_id)} (chunk {s.chunk_index}, score {s.score:.3f})"


def answer_footer(answer, sources: bool = True) -> list[str]:
    """The lines after an answer (on stderr): its sources, then what it reused and how long it took."""
    lines = [f"source: {source_line(s)}" for s in (answer.sources if sources else [])]
    st = answer.stats
    rate = st.generated_tokens / st.decode_s if st.decode_s else 0.0
    recomputed = f"{st.recomputed_tokens} recomputed, " if st.recomputed_tokens else ""
    stored_as = f" (KV stored as {st.kv_quant}: approximate)" if st.kv_quant != "none" else ""
    mode = f"{st.mode} (approximate: may differ from a full prefill)" if st.is_approximate else st.mode
    if st.kv_source:
        mode += {"computed": " (chunk KV computed now: not stored yet)", "ram": " (chunk KV from RAM)", "store": ""}[
            st.kv_source
        ]
    lines.append(
        f"{mode}{stored_as}: {st.reused_tokens} tokens reused, {recomputed}{st.computed_tokens} computed, "
        f"{st.generated_tokens} generated | "
        f"retrieval {st.retrieval_ms:.0f} ms, catalog {st.catalog_ms:.0f} ms, KV load {st.kv_load_ms:.0f} ms, "
        f"prefill {st.prefill_ms:.0f} ms, "
        f"TTFT {st.ttft_s:.2f} s, total {st.total_s:.2f} s ({rate:.1f} tokens/s)"
    )
    return lines + [f"warning: {warning}" for warning in st.warnings]


def search_lines(results: list[dict]) -> list[str]:
    lines = []
    for rank, r in enumerate(results, start=1):
        snippet = " ".join(r["text"].split())
        snippet = snippet if len(snippet) <= 100 else snippet[:99] + "…"
        where = r["citation"] or r["doc_id"]
        lines.append(f"{rank}. {where} (chunk {r['chunk_index']}, score {r['score']:.3f})  {snippet}")
    return lines


def batch_lines(summary: dict, out: Path) -> list[str]:
    savings = summary["savings"]
    return [
        f"{summary['answered']} answered, {len(summary['errors'])} errors, {summary['seconds']:.1f} s "
        f"({summary['questions_per_s']} questions/s) -> {out}",
        f"prefill: {savings['prompt_tokens']:,} prompt tokens, {savings['prefilled_tokens']:,} prefilled "
        f"({savings['saved_pct']}% saved over {savings['requests']} requests)",
    ]


def calibrate_lines(result, store: str) -> list[str]:
    lines = [
        f"  {m.mode:6} {m.share:4.0%}: first token {m.first_token:4.0%}, teacher-forced "
        f"{m.teacher_forced:4.0%}, TTFT {m.ttft_ratio:.2f}x full"
        for m in result.measured
    ]
    lines.append(f"  exact: TTFT {result.exact_ttft_ratio:.2f}x full")
    chosen = f"{result.chosen.mode} {result.chosen.share:.0%}" if result.chosen else "exact (gated)"
    return lines + [f"--mode approximate on {store}: {chosen} ({result.describe()})"]


def budget_lines(summary: dict) -> list[str]:
    limit = summary["kv_budget"]
    evicted = f"; {summary['evicted']} chunks' KV evicted" if summary.get("evicted") else ""
    held = f"{format_bytes(limit)} budget" if limit is not None else "no budget (all KV kept)"
    return [f"{summary['store']}: KV takes {format_bytes(summary['kv_bytes'])} of {held}{evicted}"]


def _prompts(prompts: dict | None) -> str:
    if prompts is None:
        return "none recorded (written before ragkv recorded them): questions and chunks embedded plainly"
    return f"query {prompts['query']!r}, document {prompts['document']!r}"


def stats_lines(summary: dict) -> list[str]:
    lines = [
        f"{summary['store']} generation {summary['generation']} (written by ragkv {summary['written_by']}): "
        f"{summary['documents']} documents, "
        f"{summary['chunks']} chunks, {summary['kv_entries']} KV entries; embedder {summary['embedder']}",
        f"  embedding prompts: {_prompts(summary.get('embedder_prompts'))}",
    ]
    lines += [
        f"  {p['model']} ({p['dtype']}): {p['chunks']} chunks, {p['tokens']:,} tokens, {mib(p['kv_bytes'])}"
        + _state_note(p)
        for p in summary["profiles"]
    ]
    lines += [
        f"shards: {summary['shards']} files, {mib(summary['shard_bytes'])} on disk, {mib(summary['live_bytes'])} live, "
        f"{mib(summary['dead_bytes'])} dead ({summary['shards_unreferenced']} unreferenced files)",
        "  dead bytes: retired KV; `ragkv gc` deletes unreferenced files and rewrites shards under half live",
    ]
    if summary.get("pending_objects"):
        lines.append(
            f"pending: {summary['pending_objects']} objects of KV readers computed ({mib(summary['pending_bytes'])}); "
            "`ragkv fold` stores them"
        )
    return lines + _index_lines(summary) + _usage_lines(summary)


def _state_note(profile: dict) -> str:
    """Where a model keeps recurrent state: how many layers, and what each entry holds of it."""
    if not profile.get("state_layers"):
        return ""
    return (
        f" (with {profile['state_layers']} recurrent layers' state: {mib(profile['state_bytes_per_entry'])} per entry)"
    )


def _index_lines(summary: dict) -> list[str]:
    index, cat, limit = summary["index"], summary["catalog"], summary["kv_budget"]
    tuned = (
        f", nlist {index['nlist']}, nprobe {index['nprobe']} (recall@10 {index['tuned_recall_at_10']:.2f} when built)"
        + (f", the best {index['rescore']} re-scored from the vectors on disk" if index.get("rescore") else "")
        if index["type"] != "flat"
        else ", exact search"
    )
    used = f"{format_bytes(limit)}, {format_bytes(summary['live_bytes'])} used" if limit is not None else "none"
    return [
        f"vector index: {index['type']}, {index['vectors']} vectors of {index['dim']} dims in "
        f"{index['segments']} segments ({index['tombstones']} removed ids){tuned}; "
        f"{format_bytes(index.get('ram_bytes', 0))} in a reader's memory",
        f"lexical index: {index['lexical']}, {format_bytes(index['lexical_bytes'])} "
        "(BM25: --retrieval lexical, hybrid)",
        f"catalog: {cat['base_rows']:,} rows in its base, {cat['delta_rows']:,} in this generation's delta "
        "(`ragkv gc` compacts the delta and the segments)",
        f"KV budget: {used}",
    ]


def _usage_lines(summary: dict) -> list[str]:
    if not summary["uses"]:
        return []
    rate = summary["hit_rate"]
    show = lambda d: f"{d['doc_id']} ({d['uses']} uses, score {d['score']:.1f})"  # noqa: E731
    return [
        f"questions used chunks {summary['uses']} times; KV hit rate "
        f"{'n/a' if rate is None else f'{rate:.1%}'} ({summary['kv_hits']} ready, "
        f"{summary['kv_misses']} computed on a miss)",
        "  hottest: " + ", ".join(show(d) for d in summary["hottest"]),
        "  coldest: " + ", ".join(show(d) for d in summary["coldest"]),
    ]
