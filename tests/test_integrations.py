"""The engine-neutral half of the vLLM connector: which leading prompt tokens a store holds,
and their KV, matched by ragkv's key chain and verified against the stored token ids. (The
connector itself runs inside vLLM: tests/test_vllm.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import ragkv
from ragkv.core.config import AskSettings
from ragkv.core.errors import InputError, ModelError, StoreCorruptError
from ragkv.core.keys import KVKey
from ragkv.integrations.paged import LayoutError, PagedLayout, block_dim_of
from ragkv.integrations.store_match import (
    ModelIdentity,
    RequestLayout,
    StoreMatcher,
    chunk_layout,
    profile_for,
)
from ragkv.integrations.transfer import KVSaver, load_kv, slot_mapping
from ragkv.kv import cache as kv
from ragkv.kv import codec
from ragkv.store import open_snapshot, verify
from tests.conftest import QUESTIONS, build_store


@pytest.fixture(scope="module")
def identity(tiny_llama):
    return ModelIdentity.of_folder(tiny_llama, "float32")


def test_the_profile_is_found_for_the_same_model_and_refused_for_another(tiny_store, tiny_llama, identity):
    with ragkv.open(tiny_store, device="cpu") as engine:
        assert profile_for(tiny_store, identity) == engine.active.profile
    with pytest.raises(ModelError, match="holds no KV for this model in bfloat16") as err:
        profile_for(tiny_store, ModelIdentity.of_folder(tiny_llama, "bfloat16"))
    assert "\n" not in str(err.value)


def test_a_ragkv_prompt_matches_its_prefix_and_chunk_with_their_kv(tiny_store, identity):
    profile = profile_for(tiny_store, identity)
    matcher = StoreMatcher(tiny_store, profile)
    with ragkv.open(tiny_store, device="cpu") as engine:
        answer = engine.ask(QUESTIONS[0], max_new_tokens=1, context="chunk")
        ((row, _),) = engine.retrieve(QUESTIONS[0])
        prompt = answer.prompt_ids
        match = matcher.match(prompt)
        assert match.num_tokens == len(profile.prefix_ids) + len(row.token_ids)
        assert [e.kv_key for e in match.entries] == [matcher.prefix_entry.kv_key, row.entry.kv_key]
        stored = load_kv(engine.snapshot.shards, match.entries, torch.float32).kv
        assert stored.shape[3] == match.num_tokens
        cache = engine.assemble([row], AskSettings(context="chunk")).cache  # prefix + chunk, read by the engine
        expected = kv.from_cache(cache, 0, 0, match.num_tokens).kv
        assert torch.equal(stored, expected)
    changed = list(prompt)
    changed[len(profile.prefix_ids) + 3] += 1  # one token of the chunk differs: only the prefix matches
    assert matcher.match(changed).num_tokens == len(profile.prefix_ids)
    assert matcher.match(prompt[1:]) is None  # no system prefix: nothing
    matcher.close()


def test_a_span_matches_through_its_continuations(tiny_llama, corpus, tmp_path, identity):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "long.md").write_text(
        " ".join(f"Paragraph {i} explains the deploy step number {i} in detail." for i in range(40))
    )
    build_store(docs, tmp_path / "s", str(tiny_llama), chunk_tokens=64, span_tokens=400)
    profile = profile_for(tmp_path / "s", identity)
    with ragkv.open(tmp_path / "s", device="cpu") as engine:
        answer = engine.ask("What is deploy step number 3?", max_new_tokens=1, context="document")
        separator = engine.active.layout.separator_ids
        num_context = len(answer.prompt_ids) - len(
            engine.active.layout.question_ids(engine.lm.tokenizer, "What is deploy step number 3?")
        )
    match = StoreMatcher(tmp_path / "s", profile, separator).match(answer.prompt_ids)
    assert len(match.entries) > 2 and match.num_tokens == num_context


def test_slots_follow_the_request_blocks():
    assert slot_mapping([7, 2, 9], 4, 2, 10).tolist() == [30, 31, 8, 9, 10, 11, 36, 37]


def test_the_matcher_sees_a_newer_generation(tiny_llama, corpus, tmp_path, identity):
    build_store(corpus, tmp_path / "s", str(tiny_llama), precompute=0)
    profile = profile_for(tmp_path / "s", identity)
    matcher = StoreMatcher(tmp_path / "s", profile)
    with ragkv.open(tmp_path / "s", device="cpu", write_back=False) as engine:
        prompt = engine.ask(QUESTIONS[1], max_new_tokens=1).prompt_ids
    assert matcher.match(prompt).num_tokens == len(profile.prefix_ids)  # no chunk KV yet
    with ragkv.open(tmp_path / "s", device="cpu") as engine:
        engine.ask(QUESTIONS[1], max_new_tokens=1)
        engine.flush()  # the miss is written back
    assert matcher.match(prompt).num_tokens > len(profile.prefix_ids)
    with open_snapshot(tmp_path / "s") as snapshot:
        assert matcher.snapshot.generation == snapshot.generation
    matcher.close()


# -- what a laid-out request means for the store (the save and use half) -------------------------
def test_params_lay_out_chunks_after_the_prefix_joined_by_the_separator():
    params = {"ragkv": {"chunks": [[7, 5], [9, 3]], "write_back": True}}
    layout = chunk_layout(params, prompt_len=30, prefix_len=10, separator_len=2)
    assert [(c.chunk_id, c.start, c.end) for c in layout.chunks] == [(7, 10, 15), (9, 17, 20)] and layout.write_back
    for nothing in (None, {"ragkv": "skip"}, {"other": 1}):
        assert chunk_layout(nothing, 30, 10, 2) == RequestLayout()


@pytest.mark.parametrize(
    "block, problem",
    [
        ("yes", "must be an object"),
        ({"chunks": [[1, 5]], "extra": 1}, "unknown fields: extra"),
        ({"chunks": [[1, 0]]}, r"\[0\] must be \[chunk_id, num_tokens\]"),
        ({"chunks": [["1", 5]]}, r"\[0\] must be"),
        ({"chunks": [[True, 5]]}, r"\[0\] must be"),
        ({"chunks": [[1, 5, 6]]}, r"\[0\] must be"),
        ({"chunks": {"a": 1}}, "must be a list"),
        ({"chunks": [], "write_back": "yes"}, "a boolean"),
        ({"chunks": [[1, 25]]}, "lays out 35 tokens, more than the prompt's 30"),
    ],
)
def test_malformed_params_are_one_line_input_errors(block, problem):
    with pytest.raises(InputError, match=problem) as err:
        chunk_layout({"ragkv": block}, 30, 10, 2)
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="kv_transfer_params must be an object"):
        chunk_layout(["ragkv"], 30, 10, 2)


def test_a_missing_chunk_is_saved_under_ingest_key_and_uses_are_what_ragkv_logs(tiny_llama, corpus, tmp_path, identity):
    """The plan for a lazy store (no chunk KV): the first chunk is saved under the key ingest
    gives it, only when its ids are its text's; each chunk's use is logged with its source."""
    from ragkv.core.config import AskSettings
    from ragkv.model.prompt import PromptLayout

    store = tmp_path / "lazy"
    build_store(corpus, store, str(tiny_llama), precompute=0)
    profile = profile_for(store, identity)
    separator = PromptLayout.build(identity.tokenizer, "").separator_ids
    matcher = StoreMatcher(store, profile, separator, identity.tokenizer)
    with ragkv.open(store, device="cpu", weights=False) as engine:
        prompt = engine.prompt_for(QUESTIONS[0], AskSettings(top_k=2, context="chunk"))
    rows = [row for row, _ in prompt.retrieved]
    params = {
        "ragkv": {
            "chunks": [[row.chunk_id, len(ids)] for row, ids in zip(rows, prompt.chunk_ids, strict=False)],
            "write_back": True,
        }
    }
    layout = chunk_layout(params, len(prompt.prompt_ids), len(profile.prefix_ids), len(separator))
    chunks, write_back = layout.chunks, layout.write_back
    match = matcher.match(prompt.prompt_ids)
    assert match.num_tokens == len(profile.prefix_ids)  # the prefix only
    plan = matcher.plan(prompt.prompt_ids, chunks, write_back, match)
    first = prompt.chunk_ids[0]
    (save,) = plan.saves  # the first chunk, stored alone: what follows it was computed after it
    assert save.kv_key == KVKey.for_chunk(profile, first).to_string() and save.token_ids == tuple(first)
    assert (save.start, save.end) == (len(profile.prefix_ids), len(profile.prefix_ids) + len(first))
    assert [(u.doc_id, u.chunk_index, u.source) for u in plan.uses] == [
        (rows[0].doc_id, rows[0].chunk_index, "computed"),
        (rows[1].doc_id, rows[1].chunk_index, "live"),
    ]
    assert matcher.plan(prompt.prompt_ids, chunks, False, match).saves == ()  # not asked to save
    # Ids that are not the chunk's text (a client naming the wrong chunk) are never saved as it.
    forged = list(prompt.prompt_ids)
    forged[chunks[0].start] = (forged[chunks[0].start] + 1) % len(identity.tokenizer)
    assert matcher.plan(forged, chunks, True, match).saves == ()
    matcher.close()


def test_a_span_store_saves_every_missing_chunk_of_a_span_from_its_start(tiny_llama, tmp_path, identity):
    """Under a budget a span's KV may be missing: a prompt holding a span from its start, laid
    out as ingest computed it, saves each chunk the store lacks under ingest's chained key,
    from the first missing one on; a prompt opening inside a span saves nothing (that KV
    continues chunks the prompt lacks)."""
    from ragkv.kv import spans
    from ragkv.model.prompt import PromptLayout
    from ragkv.store.gc import drop_dead, maintaining
    from tests.test_spans import SPAN_TOKENS, write_doc

    store = tmp_path / "spans"
    build_store(write_doc(tmp_path / "docs"), store, str(tiny_llama), chunk_tokens=24, span_tokens=SPAN_TOKENS)
    profile = profile_for(store, identity)
    separator = PromptLayout.build(identity.tokenizer, "").separator_ids
    with open_snapshot(store) as snapshot:
        ids = sorted(snapshot.catalog.documents.chunk_ids())
        rows = [r for r in snapshot.catalog.entries.context_rows(profile.profile_id, ids) if r.doc_id == "incidents.md"]
    span = [r for r in rows if r.span_start == rows[0].span_start]
    assert len(span) >= 3
    ingested = [r.entry.kv_key for r in span]
    assert ingested == [k.to_string() for k in spans.span_keys(profile, [r.token_ids for r in span], separator)]
    with maintaining(store) as writer:  # the budget evicted the span's tail: all but its first chunk
        writer.catalog.entries.evict(profile.profile_id, ingested[1:])
        drop_dead(writer)
        writer.publish()
    matcher = StoreMatcher(store, profile, separator, identity.tokenizer)

    def saves_of(span_rows):
        prompt = [*profile.prefix_ids]
        for i, row in enumerate(span_rows):
            prompt += [*(separator if i else ()), *row.token_ids]
        prompt += [*separator, 42]  # the question
        params = {"ragkv": {"chunks": [[r.chunk_id, len(r.token_ids)] for r in span_rows], "write_back": True}}
        chunks = chunk_layout(params, len(prompt), len(profile.prefix_ids), len(separator)).chunks
        match = matcher.match(prompt)
        plan = matcher.plan(prompt, chunks, True, match)
        return match, plan

    match, plan = saves_of(span)
    assert match.num_tokens == len(profile.prefix_ids) + len(span[0].token_ids)  # the first chunk is stored
    assert [t.kv_key for t in plan.saves] == ingested[1:]  # every missing chunk, keyed as ingest keyed it
    assert [t.parent for t in plan.saves] == ingested[:-1]
    assert all(t.span_start == span[0].span_start for t in plan.saves)
    assert plan.saves[0].start == match.num_tokens and plan.saves[-1].end == match.num_tokens + sum(
        len(separator) + len(r.token_ids) for r in span[1:]
    )
    assert [u.source for u in plan.uses] == ["store", *["computed"] * (len(span) - 1)]
    assert saves_of(span[1:])[1].saves == ()  # opens inside the span
    matcher.close()


# -- reading KV back out of a paged cache, whatever the backend's block layout -------------------
BLOCK, HEADS, DIM, BLOCKS = 32, 3, 8, 7


def _cpu_like(key, value, cache, slots):
    """A block as (H, 2 x block, D): keys then values per head (vLLM's CPU backend)."""
    halves = cache.view(cache.shape[0], HEADS, 2 * BLOCK, DIM)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK)
        halves[block, :, offset], halves[block, :, BLOCK + offset] = key[t], value[t]


def _flash_like(key, value, cache, slots):
    """(2, blocks, block, H, D): keys and values apart, blocks second (FlashAttention's)."""
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK)
        cache[0, block, offset], cache[1, block, offset] = key[t], value[t]


def _shuffled(key, value, cache, slots):
    """A fixed scramble of each block's elements: no layout the reader could assume."""
    order = torch.randperm(2 * BLOCK * HEADS * DIM, generator=torch.Generator().manual_seed(3))
    flat = cache.view(cache.shape[0], -1)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK)
        both = torch.zeros(2, BLOCK, HEADS, DIM, dtype=cache.dtype)
        both.view(-1)[:] = flat[block][order.argsort()]
        both[0, offset], both[1, offset] = key[t], value[t]
        flat[block] = both.view(-1)[order]


@pytest.mark.parametrize(
    "write, shape",
    [
        (_cpu_like, (BLOCKS, HEADS, BLOCK, 2 * DIM)),
        (_flash_like, (2, BLOCKS, BLOCK, HEADS, DIM)),
        (_shuffled, (BLOCKS, 2 * BLOCK * HEADS * DIM)),
    ],
    ids=["cpu", "flash", "scrambled"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probed_layout_reads_back_exactly_what_the_backend_wrote(write, shape, dtype):
    cache = torch.zeros(shape, dtype=dtype)
    layout = PagedLayout.probe(write, cache, block_dim_of(cache, BLOCKS), BLOCK, HEADS, DIM)
    blocks, start, num_tokens = [5, 2, 6], 10, 70  # a request's blocks; its tokens 10..79
    key, value = torch.randn(num_tokens, HEADS, DIM).to(dtype), torch.randn(num_tokens, HEADS, DIM).to(dtype)
    write(key, value, cache, slot_mapping(blocks, BLOCK, start, start + num_tokens))
    got = layout.gather(cache, blocks, start, start + num_tokens)
    assert torch.equal(got[0], key.transpose(0, 1)) and torch.equal(got[1], value.transpose(0, 1))


def test_a_layout_that_loses_tokens_is_refused():
    def drops_values(key, value, cache, slots):
        _flash_like(key, torch.zeros_like(value), cache, slots)

    with pytest.raises(LayoutError, match="does not place each token's keys and values once"):
        PagedLayout.probe(drops_values, torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM), 1, BLOCK, HEADS, DIM)
    with pytest.raises(LayoutError, match="which dimension"):
        block_dim_of(torch.zeros(7, 3, 7), 7)


# -- saving what an engine computed: the store's write-back, and its faults ----------------------
SAVER_KILLED = """
import sys; sys.path.insert(0, {root!r})
import torch
from tests.test_integrations import saves_for
from ragkv.integrations.transfer import KVSaver
from tests.faults import kill_after_sealing_a_shard
targets, kv, profile = saves_for({full!r}, {lazy!r}, {model!r})
kill_after_sealing_a_shard()
saver = KVSaver({lazy!r}, profile, "tiny", "test")
saver.submit(targets[0], kv[0])
saver.flush()
print("not killed")
"""


def saves_for(full: str, lazy: str, model: str):
    """What an engine would save for each question on the lazy store: the plan's targets, the
    KV (ingest's, read from the full store), and the profile."""
    from ragkv.core.config import AskSettings
    from ragkv.model.prompt import PromptLayout

    identity = ModelIdentity.of_folder(model, "float32")
    profile = profile_for(lazy, identity)
    separator = PromptLayout.build(identity.tokenizer, "").separator_ids
    matcher = StoreMatcher(lazy, profile, separator, identity.tokenizer)
    targets, kvs = [], []
    with ragkv.open(lazy, device="cpu", weights=False) as engine, open_snapshot(full) as reference:
        for question in QUESTIONS:
            prompt = engine.prompt_for(question, AskSettings(top_k=1, context="chunk"))
            (row, _), ids = prompt.retrieved[0], prompt.chunk_ids[0]
            chunks = chunk_layout(
                {"ragkv": {"chunks": [[row.chunk_id, len(ids)]]}},
                len(prompt.prompt_ids),
                len(profile.prefix_ids),
                len(separator),
            ).chunks
            (target,) = matcher.plan(prompt.prompt_ids, chunks, True, matcher.match(prompt.prompt_ids)).saves
            entry = reference.catalog.entries.entry(target.kv_key)
            kvs.append(
                codec.decode(reference.shards.read_parts(entry.shard, entry.tensor, entry.checksum), torch.float32).kv
            )
            targets.append(target)
    matcher.close()
    return targets, kvs, profile


@pytest.fixture()
def full_and_lazy(tiny_llama, corpus, tmp_path):
    build_store(corpus, tmp_path / "full", str(tiny_llama))
    build_store(corpus, tmp_path / "lazy", str(tiny_llama), precompute=0)
    return tmp_path / "full", tmp_path / "lazy"


def test_kv_a_replica_left_pending_is_read_there_then_from_the_store_once_folded(full_and_lazy):
    """A replica loads KV another left pending: from the pending area, and, when the fold
    took it between the match and the read, from the store's newest generation; the same
    tensors either way. A key neither pending nor stored is a one-line StoreCorruptError."""
    from ragkv.store import EntryRow
    from ragkv.store.kv.pending import PendingArea, PendingIndex, PendingWriter
    from ragkv.store.kv.shards import SHARD_SUFFIX
    from ragkv.store.kv.writeback import fold
    from tests.conftest import computed_kv_of

    full, lazy = full_and_lazy
    batch, rows = computed_kv_of(full)
    PendingWriter(lazy, pending_bytes=1 << 30).put(batch)
    area = PendingArea(lazy)
    index = PendingIndex(area)
    entries = []
    for row in rows:
        found = index.lookup(row.entry.kv_key)
        assert found is not None
        entries.append(
            EntryRow(found.kv_key, found.shard, found.kv_key, row.entry.num_tokens, "float32", found.checksum, 0)
        )
    pending = frozenset(e.kv_key for e in entries)
    with open_snapshot(full) as reference:
        expected = load_kv(reference.shards, [r.entry for r in rows], torch.float32).kv
    with open_snapshot(lazy) as snapshot:
        assert snapshot.catalog.entries.entry(entries[0].kv_key) is None  # not stored yet: only pending
        assert torch.equal(load_kv(snapshot.shards, entries, torch.float32, pending, area, lazy).kv, expected)
        assert fold(lazy).stored == len(entries)
        assert not [n for n in area.names() if n.endswith(SHARD_SUFFIX)]  # the fold took them from pending/
        assert torch.equal(load_kv(snapshot.shards, entries, torch.float32, pending, area, lazy).kv, expected)
        unknown = EntryRow("0" * 64, entries[0].shard, "0" * 64, 1, "float32", entries[0].checksum, 0)
        with pytest.raises(StoreCorruptError, match="left pending is neither pending nor stored") as err:
            load_kv(snapshot.shards, [unknown], torch.float32, frozenset([unknown.kv_key]), area, lazy)
        assert "\n" not in str(err.value)


def test_saved_kv_is_served_token_identically_and_counted_once(full_and_lazy, tiny_llama):
    full, lazy = full_and_lazy
    targets, kvs, profile = saves_for(str(full), str(lazy), str(tiny_llama))
    saver = KVSaver(lazy, profile, "tiny", "test")
    for target, kv_tensor in zip(targets + targets, kvs + kvs, strict=False):  # each twice: one entry each
        saver.submit(target, kv_tensor)
    saver.flush()
    saver.close()
    assert saver.write_back.report.failures == 0
    with open_snapshot(lazy) as snapshot:
        assert verify(snapshot).ok
        assert snapshot.catalog.reports.counts()["kv_entries"] == 1 + len({t.kv_key for t in targets})
        shard = next((lazy / "shards").rglob(snapshot.catalog.entries.entry(targets[0].kv_key).shard))
        assert safe_open(str(shard), "pt").metadata()["engine"] == "test"  # which engine computed it
    with ragkv.open(lazy, device="cpu") as served, ragkv.open(full, device="cpu") as reference:
        for question in QUESTIONS:
            got = served.ask(question, max_new_tokens=8, context="chunk")
            assert got.stats.kv_source == "store"
            assert got.token_ids == reference.ask(question, max_new_tokens=8, context="chunk").token_ids


def test_a_save_behind_another_writer_waits_then_gives_up_and_a_full_disk_warns_once(
    full_and_lazy, tiny_llama, monkeypatch, caplog
):
    import errno
    import logging

    from ragkv.store.kv import writeback
    from ragkv.store.kv.shards import ShardWriter
    from ragkv.store.writer import open_writer

    full, lazy = full_and_lazy
    targets, kvs, profile = saves_for(str(full), str(lazy), str(tiny_llama))
    with open_snapshot(lazy) as snapshot:
        generation = snapshot.generation
    monkeypatch.setattr(writeback, "LOCK_WAIT_S", 0.0)
    saver = KVSaver(lazy, profile, "tiny", "test")
    with open_writer(lazy):  # an ingest holds the store
        saver.submit(targets[0], kvs[0])
        saver.flush()
    assert saver.write_back.report.dropped == 1
    monkeypatch.setattr(
        ShardWriter, "flush", lambda self: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left"))
    )
    with caplog.at_level(logging.WARNING, logger="ragkv"):
        for target, kv_tensor in zip(targets, kvs, strict=False):
            saver.submit(target, kv_tensor)
            saver.flush()
    saver.close()
    assert saver.write_back.report.failures == len(targets)
    assert len([r for r in caplog.records if "could not store computed KV" in r.getMessage()]) == 1
    with open_snapshot(lazy) as snapshot:  # nothing stored, nothing harmed
        assert verify(snapshot).ok and snapshot.generation == generation
        assert snapshot.catalog.reports.counts()["kv_entries"] == 1


def test_a_kill_mid_save_leaves_the_store_as_published(full_and_lazy, tiny_llama):
    import subprocess
    import sys

    from tests.conftest import ROOT

    full, lazy = full_and_lazy
    script = SAVER_KILLED.format(root=str(ROOT), full=str(full), lazy=str(lazy), model=str(tiny_llama))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9 and "not killed" not in proc.stdout, proc.stderr[-2000:]
    with open_snapshot(lazy) as snapshot:  # the sealed shard was never committed: an orphan gc removes
        assert verify(snapshot).ok and snapshot.catalog.reports.counts()["kv_entries"] == 1


def test_ingest_on_vllm_without_vllm_is_one_line_and_writes_nothing(tmp_path):
    import sys

    from tests.conftest import SAMPLE_DATA, run_cli

    store = tmp_path / "kvstore"
    result = run_cli("ingest", SAMPLE_DATA, "--store", store, "--engine", "vllm", "--vllm-python", sys.executable)
    assert result.exit_code == 2 and "has no vllm" in result.output and "tests/vllm_env.sh" in result.output
    assert not store.exists()
