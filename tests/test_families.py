"""Every model family people serve is exact from the store or refused in one line, never silently
inexact. Tiny random models of each family (tests/families.py: 2 layers, sliding windows
shorter than a chunk, recurrent layers beside attention), float32, answers compared with full
prefills; the self-test refuses a deliberately broken cache, KV or recurrent state."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

import ragkv
from ragkv.core.config import AskSettings
from ragkv.core.errors import ModelError
from ragkv.engine.batch import Question, answer_all
from ragkv.kv import cache as kv
from ragkv.kv import direct
from ragkv.kv.entry import Entry
from ragkv.kv.movable import refuse_unless_movable
from ragkv.kv.packed import packable
from ragkv.kv.ragged import RaggedBatch
from ragkv.model import self_check
from ragkv.model.generate import prefill, step
from ragkv.model.llm import load_model
from ragkv.store import open_snapshot
from tests import families
from tests.conftest import QUESTIONS, build_store, run_cli
from tests.test_conversation import full_prefill_answer
from tests.test_exactness import assert_cached_equals_full
from tests.test_spans import QUESTION as SPAN_QUESTION
from tests.test_spans import SPAN_TOKENS, _assert_exact, write_doc

NEW_LAYOUTS = [  # the layouts beyond plain full attention, each through the whole engine
    "mistral (sliding)",
    "gemma2 (sliding + full, soft-capping)",
    "gemma3 (sliding + full)",
    "gpt-oss (sliding + full, sinks)",
    "cohere2 (sliding + full)",
    "deepseek-v3 (latent attention)",
    *families.HYBRID,
]


@pytest.fixture(scope="session")
def family_model(tmp_path_factory):
    """`family_model(name)`: the folder of a tiny random model of that family, built once."""
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = families.build(family, tmp_path_factory.mktemp("family") / "model")
        return built[family]

    return get


@pytest.fixture(scope="session")
def family_store(family_model, corpus, tmp_path_factory):
    """`family_store(name)`: a float32 store of the small corpus (24-token chunks) for that family."""
    built = {}

    def get(family: str):
        if family not in built:
            store = tmp_path_factory.mktemp("family-store") / "store"
            build_store(corpus, store, str(family_model(family)), chunk_tokens=24)
            built[family] = store
        return built[family]

    return get


def test_the_families_windows_are_shorter_than_a_chunk_so_they_matter():
    assert families.WINDOW < 24


@pytest.mark.parametrize("family", families.exact_families())
def test_every_exact_family_passes_the_self_test_and_a_broken_cache_fails_it(family, family_model):
    lm = load_model(str(family_model(family)), "cpu", "float32")
    check = self_check.check_loaded(lm)  # raises when the family is not exact
    assert check.passed and check.difference < 1e-6 and check.model_class == type(lm.model).__name__

    def noisy_last_layer(entry: Entry) -> Entry:  # the last KV layer off by 5% of its spread
        last = entry.groups[-1].clone()  # (L_g, 2, H, T, D) or (L_g, 1, H, T, Dk + Dv)
        last[-1] = _noisy(last[-1])
        return Entry((*entry.groups[:-1], last), entry.state)

    broken = self_check.run(lm.model, lm.tokenizer, "float32", lm.pad_id, perturb=noisy_last_layer)
    assert not broken.passed
    with pytest.raises(ModelError, match=f"refuses {type(lm.model).__name__} in float32: .* differs .* by"):
        broken.refuse()


def _noisy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` off by 5% of its spread."""
    noise = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(0))
    return tensor + 0.05 * tensor.float().std() * noise.to(tensor.dtype)


@pytest.mark.parametrize("family", families.STATEFUL)
@pytest.mark.parametrize("kind", ["conv", "recurrent"])
def test_a_perturbed_recurrent_state_fails_the_self_test(family, kind, family_model):
    lm = load_model(str(family_model(family)), "cpu", "float32")
    specs = [spec for spec in lm.facts.layout.states if spec.kind == kind]
    if not specs:
        pytest.skip(f"{family} keeps no {kind} state")

    def noisy_state(entry: Entry) -> Entry:  # one state off by 5% of its spread, the KV intact
        assert entry.state is not None
        return entry.with_state({**entry.state, specs[0].name: _noisy(entry.state[specs[0].name])})

    broken = self_check.run(lm.model, lm.tokenizer, "float32", lm.pad_id, perturb=noisy_state)
    assert not broken.passed, broken.difference


@pytest.mark.parametrize("family", families.refused_families())
def test_families_whose_state_cannot_continue_are_refused_in_one_line_at_ingest_and_at_open(
    family, family_model, corpus, tiny_store
):
    folder = family_model(family)
    result = run_cli("ingest", corpus, "--store", corpus.parent / "refused", "--model", folder, "--device", "cpu")
    assert result.exit_code != 0
    said = [line for line in result.output.splitlines() if line.strip()]
    assert len(said) == 1 and "cannot serve" in said[0] and "zero state" in said[0], result.output
    assert "internal error" not in result.output
    assert not (corpus.parent / "refused").exists()
    with pytest.raises(ModelError, match="cannot serve .* exactly"):
        ragkv.open(tiny_store, model=str(folder), device="cpu")


@pytest.mark.parametrize("family", NEW_LAYOUTS)
def test_one_and_several_chunks_from_the_store_equal_a_full_prefill(family, family_store):
    store = family_store(family)
    assert_cached_equals_full(store, QUESTIONS[:2], max_new_tokens=12, top_k=1)
    assert_cached_equals_full(store, QUESTIONS[2:], max_new_tokens=8, top_k=3)  # the first from the store


@pytest.mark.parametrize("family", NEW_LAYOUTS)
def test_spans_across_chunk_borders_equal_a_full_prefill(family, family_model, tmp_path):
    store = tmp_path / "store"
    docs = write_doc(tmp_path / "docs")
    build_store(docs, store, str(family_model(family)), chunk_tokens=24, span_tokens=SPAN_TOKENS)
    with ragkv.open(store, device="cpu") as engine:
        answer = _assert_exact(engine, SPAN_QUESTION, AskSettings(context="span", doc_ids=("incidents.md",)))
        assert len(answer.sources) >= 2 or answer.sources[0].chunk_index == 0


@pytest.mark.parametrize("family", NEW_LAYOUTS)
def test_conversation_turns_equal_a_full_prefill(family, family_store):
    with ragkv.open(family_store(family), device="cpu") as engine:
        chat = engine.conversation(max_new_tokens=10)
        for number, message in enumerate([QUESTIONS[0], "And who stores the new key?"]):
            answer = chat.ask(message)
            assert answer.token_ids == full_prefill_answer(engine, answer.prompt_ids, 10), number
            assert answer.stats.reused_tokens > 0


PLAIN = [name for name, (_, _, verdict) in families.FAMILIES.items() if verdict == "exact" and name not in NEW_LAYOUTS]


@pytest.mark.parametrize("family", [*PLAIN, *NEW_LAYOUTS])
def test_packed_steps_are_taken_by_plain_attention_models_only(family, family_model):
    """Packed steps (a prompt fed beside the decode rows) where every layer is full attention
    of one shape: the plain families; sliding, soft-capped, latent and stateful ones decode in
    padded steps."""
    model = load_model(str(family_model(family)), "cpu", "float32").model
    assert packable(model) is (family in PLAIN)


DIRECT = ["llama", "qwen2", "qwen3"]  # the Llama kind: ragkv.kv.direct writes their packed step out


@pytest.mark.parametrize("family", PLAIN)
def test_the_written_out_packed_step_is_bitwise_the_models_own(family, family_model, monkeypatch):
    """ragkv.kv.direct takes the packed steps of the Llama kind only, and computes exactly what
    the model's own forward does: the same logits to the bit and the same keys and values, with
    a prompt's chunk fed beside decoding rows and in the plain steps after it."""
    model = load_model(str(family_model(family)), "cpu", "float32").model
    assert direct.serves(model) is (family in DIRECT)
    if family not in DIRECT:
        return
    generator = torch.Generator().manual_seed(3)
    contexts = [torch.randint(3, 900, (length,), generator=generator).tolist() for length in (9, 30, 17)]
    feeds = [[5], [6], torch.randint(3, 900, (11,), generator=generator).tolist()]  # two decode, one prompt
    (ours, theirs), step = _batches_of(model, monkeypatch, contexts)
    for fed in (feeds, [[7], [8], [9]], [[7], [8], [9]]):
        mine, own = step(fed)
        assert torch.equal(mine, own)
    for row in range(3):
        assert torch.equal(kv.from_cache(ours.extract(row)).kv, kv.from_cache(theirs.extract(row)).kv)


def _batches_of(model, monkeypatch, contexts: list[list[int]]):
    """Two batches of the same `contexts` (one row each): one stepped written out, one by the
    model's own forward; `step(feeds)` steps both and returns their logits."""
    batches = []
    for _ in range(2):
        batch = RaggedBatch(model.config)
        for ids in contexts:
            cache = kv.to_cache_empty(model.config)
            prefill(model, ids, cache)
            batch.add(cache)
        batches.append(batch)

    def step(feeds: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        found = []
        for written_out, batch in zip((True, False), batches, strict=True):
            monkeypatch.setattr(direct, "serves", lambda _, w=written_out: w)
            with torch.inference_mode():
                found.append(batch.step_packed(model, feeds))
        return found[0], found[1]

    return batches, step


def _decoding(model, monkeypatch, rows: int):
    """`_batches_of` `rows` random contexts of 9, 12, ... tokens; `step(token)` feeds each row one."""
    generator = torch.Generator().manual_seed(5)
    contexts = [torch.randint(3, 900, (length,), generator=generator).tolist() for length in range(9, 9 + 3 * rows, 3)]
    batches, step = _batches_of(model, monkeypatch, contexts)
    return batches, lambda token: step([[token + row] for row in range(rows)])


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: projections with a bias
def test_steps_of_five_to_sixteen_rows_take_packed_weights_that_agree_and_are_never_stale(
    family, family_model, monkeypatch
):
    """A float32 step of 5-16 tokens on a CPU runs its projections through MKL's packed weights
    (a copy for 8 rows, one for 16): its logits and KV agree with the model's own forward to
    float rounding and pick the same tokens; a weight changed in place is packed again before
    the next step uses it."""
    model = load_model(str(family_model(family)), "cpu", "float32").model
    packs = direct.packs_of(model)
    assert packs is not None
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for rows, copies in ((6, 1), (8, 1), (12, 2), (16, 2)):
        batches, step = _decoding(model, monkeypatch, rows)
        for token in (5, 6):
            mine, own = step(token)
            assert torch.allclose(mine, own, atol=1e-4, rtol=1e-4)
            assert torch.equal(mine.argmax(-1), own.argmax(-1))
        assert len(packs) == copies * len(linears)  # every projection went through its copy for the rows
        for row in range(rows):
            a, b = (kv.from_cache(batch.extract(row)).kv for batch in batches)
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # in place: the packed copies made before are stale now
    mine, own = step(7)
    assert torch.allclose(mine, own, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", PLAIN)
def test_a_lone_request_steps_written_out_on_its_own_cache_as_the_models_own_forward_does(
    family, family_model, family_store, monkeypatch
):
    """A request decoding alone feeds its tokens through `direct.step_alone` on the Llama kind
    (its own growing cache, appended in place): logits and KV agree with the model's own step to
    float rounding, with the same picks; other families and other caches take the model's own."""
    model = load_model(str(family_model(family)), "cpu", "float32").model
    ids = torch.randint(3, 900, (23,), generator=torch.Generator().manual_seed(8)).tolist()
    mine, own = kv.to_cache_empty(model.config), kv.to_cache_empty(model.config)
    prefill(model, ids, mine)
    prefill(model, ids, own)
    assert direct.serves_alone(model, mine) is (family in DIRECT)
    assert not direct.serves_alone(model, DynamicCache())
    if family in DIRECT:
        for token in (5, 6, 7):
            ours, theirs = direct.step_alone(model, token, mine), step(model, token, own)
            assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4) and int(ours.argmax()) == int(theirs.argmax())
        assert torch.allclose(kv.from_cache(mine).kv, kv.from_cache(own).kv, atol=1e-4, rtol=1e-4)
    calls, original = [], direct.step_alone
    monkeypatch.setattr(direct, "step_alone", lambda *args: calls.append(1) or original(*args))
    with ragkv.open(family_store(family), device="cpu") as engine:
        answer = engine.ask(QUESTIONS[0], AskSettings(max_new_tokens=4))
    assert (len(calls) == len(answer.token_ids) - 1) if family in DIRECT else not calls  # every token after the first


@pytest.mark.parametrize("family", DIRECT)
def test_a_lone_step_is_bitwise_the_packed_step_of_its_one_row(family, family_model, monkeypatch):
    """`direct.step_alone` leaves out the packed step's layout (packing, mask, gathering) for one
    row attending over its whole cache: its logits, keys and values are bitwise the packed step's
    of that row."""
    model = load_model(str(family_model(family)), "cpu", "float32").model
    ids = torch.randint(3, 900, (29,), generator=torch.Generator().manual_seed(9)).tolist()
    (batch, _), step = _batches_of(model, monkeypatch, [ids])
    mine = kv.to_cache_empty(model.config)
    prefill(model, ids, mine)
    for token in (5, 6, 7):
        packed, _ = step([[token]])
        assert torch.equal(direct.step_alone(model, token, mine), packed[0])
    assert torch.equal(kv.from_cache(mine).kv, kv.from_cache(batch.extract(0)).kv)


def test_a_projection_that_is_not_a_plain_linear_takes_the_models_own_forward(family_model):
    """A subclass of nn.Linear (a quantised or adapted projection) may compute something else:
    the written-out step, which multiplies by the weight itself, is not taken."""

    class Adapted(torch.nn.Linear):
        pass

    model = load_model(str(family_model("llama")), "cpu", "float32").model
    own = model.model.layers[0].mlp.down_proj
    adapted = Adapted(own.in_features, own.out_features, bias=own.bias is not None)
    adapted.load_state_dict(own.state_dict())
    model.model.layers[0].mlp.down_proj = adapted
    assert not direct.serves(model)
    assert direct.serves(load_model(str(family_model("llama")), "cpu", "float32").model)


def test_a_model_over_the_limit_gets_no_packed_weights(family_model, monkeypatch):
    monkeypatch.setattr(direct, "PACK_LIMIT", 0)
    model = load_model(str(family_model("llama")), "cpu", "float32").model
    assert direct.packs_of(model) is None
    _, step = _decoding(model, monkeypatch, 6)
    mine, own = step(5)
    assert torch.equal(mine, own)  # the plain written-out step: bitwise the model's own


@pytest.mark.parametrize("family", [*PLAIN, *NEW_LAYOUTS])
def test_the_batcher_answers_as_each_question_alone(family, family_store):
    settings = AskSettings(max_new_tokens=10)
    questions = [Question(str(i), q) for i, q in enumerate(QUESTIONS)]  # prompts of different lengths
    with ragkv.open(family_store(family), device="cpu") as engine:
        outcomes = list(answer_all(engine, questions, settings, max_batch=4))
        assert all(o.error is None for o in outcomes)
        for outcome in outcomes:
            alone = engine.ask(outcome.question.question, settings)
            assert outcome.answer.token_ids == alone.token_ids, outcome.question.question


@pytest.mark.parametrize(
    "family",
    [
        "gemma3 (sliding + full)",
        "deepseek-v3 (latent attention)",
        "gemma4 (sliding + global of other head sizes, shared KV)",
        "qwen3.5 (Gated DeltaNet + full)",
    ],
)
def test_approximate_modes_refuse_layouts_they_do_not_move(family, family_store):
    with ragkv.open(family_store(family), device="cpu") as engine:
        with pytest.raises(ModelError, match="Use --mode exact"):
            engine.ask(QUESTIONS[0], top_k=2, mode="concat")


@pytest.mark.parametrize(
    "family",
    [
        "deepseek-v3 (latent attention)",
        "gemma4 (sliding + global of other head sizes, shared KV)",
        "qwen3.5 (Gated DeltaNet + full)",
        "lfm2 (short convolutions + full)",
    ],
)
def test_the_vllm_connector_refuses_layouts_it_does_not_move_in_one_line(family, family_model):
    with pytest.raises(ModelError, match="connector moves KV of attention layers of one shape") as refused:
        refuse_unless_movable(family_model(family))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "family", ["llama", "mistral (sliding)", "gemma3 (sliding + full)", "gpt-oss (sliding + full, sinks)"]
)
def test_the_vllm_connector_takes_full_and_sliding_layers_of_one_shape(family, family_model):
    refuse_unless_movable(family_model(family))  # no error


@pytest.mark.parametrize(
    "family",
    [
        "nemotron-h (Mamba2 + attention + MLP layers)",
        "falcon-h1 (Mamba2 beside attention in every layer)",
        "granite 4 hybrid (Mamba2 + attention)",
    ],
)
def test_the_vllm_connector_loads_mamba2_hybrids_and_refuses_to_save_them(family, family_model):
    refuse_unless_movable(family_model(family))  # loads: no error
    with pytest.raises(ModelError, match="Mamba2 state, which vLLM computes only to the end of a step"):
        refuse_unless_movable(family_model(family), saves=True)  # ingest --engine vllm


def test_ingest_records_the_layout_and_the_self_test_in_the_profile(family_store):
    with open_snapshot(family_store("gemma3 (sliding + full)")) as snapshot:
        (row,) = snapshot.catalog.entries.profiles()
        entries = snapshot.catalog.reports.all_entries()
        parts = [snapshot.shards.read_parts(e.shard, e.tensor, e.checksum) for e in entries]
    # chunks longer than the window keep only its tail in the sliding layer (what the exact tests above read)
    windowed = [p for p in parts if "windowed" in p]
    assert windowed and all(p["slid"].shape[3] == families.WINDOW - 1 for p in windowed)
    assert json.loads(row.kv_layout)["windows"] == [families.WINDOW, None]
    check = self_check.SelfCheck.from_string(row.self_check)
    assert check.passed and check.model_class == "Gemma3ForCausalLM"
    assert check.machine == self_check.machine_key("cpu")


def test_an_engine_checks_a_profile_once_per_machine(family_model, monkeypatch, tmp_path):
    monkeypatch.setenv("RAGKV_HOME", str(tmp_path))
    lm = load_model(str(family_model("gpt-oss (sliding + full, sinks)")), "cpu", "float32")
    elsewhere = self_check.SelfCheck("GptOssForCausalLM", "float32", 0.0, 1e-5, 10, "another machine")
    first = self_check.check_once(lm, "p1", elsewhere.to_string())  # recorded elsewhere: runs here
    assert first.machine == self_check.machine_key("cpu") and first.passed
    assert (tmp_path / "checks" / "p1.json").is_file()

    def no_second_run(*args, **kwargs):
        raise AssertionError("the self-test ran again")

    monkeypatch.setattr(self_check, "run", no_second_run)
    assert self_check.check_once(lm, "p1", None) == first  # remembered on this machine
    failed = self_check.SelfCheck("GptOssForCausalLM", "float32", 1e-3, 1e-5, 10, first.machine)
    with pytest.raises(ModelError, match="refuses GptOssForCausalLM"):
        self_check.check_once(lm, "p2", failed.to_string())  # a recorded failure here refuses


def test_plain_profiles_keep_their_ids_and_other_layouts_get_their_own(family_store, tiny_store):
    from ragkv.core.keys import Profile

    plain = Profile("m", "t", "p", (1, 2), "float32")
    assert plain.profile_id == Profile("m", "t", "p", (1, 2), "float32", "none", "").profile_id
    assert plain.profile_id != Profile("m", "t", "p", (1, 2), "float32", "none", '{"windows":[12,null]}').profile_id


def test_a_store_written_before_layouts_were_recorded_reads_and_is_checked_once(tiny_store, tmp_path, monkeypatch):
    import shutil

    import duckdb

    from ragkv.store import StoreWriter
    from tests.conftest import fresh_home

    store = tmp_path / "older"
    shutil.copytree(tiny_store, store)
    with open_snapshot(store) as snapshot:
        generation, base = snapshot.generation, snapshot.catalog.base_name()
    for path, prefix in ((store / base, ""), (store / f"catalog-{generation:06d}.duckdb", "add_")):
        con = duckdb.connect(str(path))  # as a ragkv before 0005_profile_checks wrote it
        for column in ("kv_layout", "self_check"):
            con.execute(f"ALTER TABLE {prefix}profiles DROP COLUMN {column}")
        if not prefix:
            migrations = json.loads(con.execute("SELECT value FROM meta WHERE key = 'migrations'").fetchone()[0])
            con.execute("UPDATE meta SET value = ? WHERE key = 'migrations'", [json.dumps(migrations[:-1])])
        con.close()
    fresh_home(tmp_path / "home", monkeypatch)
    with ragkv.open(store, device="cpu") as engine:  # a reader: read as it is, the profile checked here
        assert engine.ask(QUESTIONS[0], max_new_tokens=4).stats.reused_tokens > 0
        (row,) = engine.snapshot.catalog.entries.profiles()
        assert row.kv_layout is None and row.self_check is None
    (record,) = (tmp_path / "home" / "checks").iterdir()
    assert record.stem == row.profile_id and self_check.SelfCheck.from_string(record.read_text()).passed
    with StoreWriter(store):  # the first writer migrates
        pass
    with open_snapshot(store) as snapshot:
        assert snapshot.catalog.entries.profiles()[0].profile_id == row.profile_id  # a plain profile keeps its id


def test_the_generated_families_table_lists_every_family_with_its_verdict():
    from tests.conftest import ROOT

    lines = (ROOT / "benchmarks" / "results" / "families.md").read_text().splitlines()
    for family, (_, _, verdict) in families.FAMILIES.items():
        row = next(line for line in lines if line.startswith(f"| {family} |"))
        assert ("| exact (self-test" in row) == (verdict == "exact"), f"re-run python benchmarks/families.py: {row}"


def test_a_hybrid_store_keeps_the_state_in_every_entry_and_counts_it(family_store):
    """Every entry of a recurrent model (the system prompt's too) holds each recurrent layer's
    state beside its KV, checksummed with it; its bytes count in the entry's size (what the budget
    and gc weigh), and `ragkv stats` names the state and its size per entry."""
    from ragkv.kv.layout import KVLayout
    from ragkv.store.stats import store_stats

    store = family_store("qwen3.5 (Gated DeltaNet + full)")
    with open_snapshot(store) as snapshot:
        (profile,) = store_stats(snapshot)["profiles"]
        layout = KVLayout.from_string(snapshot.catalog.entries.profiles()[0].kv_layout)
        assert profile["state_layers"] == 1 and profile["state_bytes_per_entry"] == layout.state_bytes > 0
        entries = snapshot.catalog.reports.all_entries()
        assert len(entries) > 2
        for entry in entries:
            parts = snapshot.shards.read_parts(entry.shard, entry.tensor, entry.checksum)
            states = {name.removeprefix("state."): t for name, t in parts.items() if name.startswith("state.")}
            assert {name: (tuple(t.shape), str(t.dtype)) for name, t in states.items()} == {
                spec.name: (spec.shape, f"torch.{spec.dtype}") for spec in layout.states
            }
            assert entry.nbytes == sum(t.numel() * t.element_size() for t in parts.values())
    said = run_cli("stats", "--store", store).output
    assert "1 recurrent layers' state" in said and "per entry" in said


SERVED = ["qwen3.5 (Gated DeltaNet + full)", "falcon-h1 (Mamba2 beside attention in every layer)"]


@pytest.mark.slow
@pytest.mark.parametrize("family", SERVED)
def test_serve_and_the_langchain_adapter_answer_a_hybrid_as_ask_does(family, family_store):
    """A recurrent model through `ragkv serve` (a real server: a question, streamed, and a
    follow-up on the service's kept conversation) and through the LangChain adapter: the same
    tokens as `ask`, whose answers equal full prefills (the tests above)."""
    from langchain_core.runnables import RunnablePassthrough
    from openai import OpenAI

    from ragkv.integrations.langchain import ChatRagkv, RagkvRetriever, rag_prompt
    from tests.conftest import running_server

    store = family_store(family)
    follow_up = "And who stores the new key?"
    with ragkv.open(store, device="cpu") as engine:
        first = engine.ask(QUESTIONS[0], max_new_tokens=10)
        chat = engine.conversation(max_new_tokens=10)
        chat.ask(QUESTIONS[0])
        second = chat.ask(follow_up)
        chain = (
            {"documents": RagkvRetriever(engine=engine, top_k=2), "question": RunnablePassthrough()}
            | rag_prompt
            | ChatRagkv(engine=engine, max_tokens=10)
        )
        reply = chain.invoke(QUESTIONS[1])
        alone = engine.ask(QUESTIONS[1], top_k=2, max_new_tokens=10)
        assert reply.response_metadata["ragkv"]["token_ids"] == alone.token_ids
        assert reply.response_metadata["ragkv"]["stats"]["reused_tokens"] > 0
    with running_server(store) as (base, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        message = [{"role": "user", "content": QUESTIONS[0]}]
        served = client.chat.completions.create(model="ragkv", messages=message, max_tokens=10)
        assert served.model_extra["ragkv"]["token_ids"] == first.token_ids
        streamed = client.chat.completions.create(model="ragkv", messages=message, max_tokens=10, stream=True)
        assert "".join(event.choices[0].delta.content or "" for event in streamed) == first.text
        history = [*message, {"role": "assistant", "content": served.choices[0].message.content}]
        history.append({"role": "user", "content": follow_up})
        again = client.chat.completions.create(model="ragkv", messages=history, max_tokens=10)
        extra = again.model_extra["ragkv"]
        assert extra["conversation_reused"] and extra["token_ids"] == second.token_ids


def test_order_reuse_puts_the_most_stored_chunk_first_and_stays_exact(family_store):
    """`--order reuse`: the chunk the store holds the most tokens of comes first, so more of a
    recurrent model's prompt is reused; the answer equals a full prefill of that prompt."""
    with ragkv.open(family_store("qwen3.5 (Gated DeltaNet + full)"), device="cpu") as engine:
        for question in QUESTIONS:
            retrieval = engine.ask(question, top_k=3, max_new_tokens=6)
            reuse = engine.ask(question, top_k=3, max_new_tokens=6, order="reuse")
            full = engine.ask(question, top_k=3, max_new_tokens=6, order="reuse", use_cache=False)
            assert reuse.prompt_ids == full.prompt_ids and reuse.token_ids == full.token_ids
            assert sorted(s.chunk_id for s in reuse.sources) == sorted(s.chunk_id for s in retrieval.sources)
            lengths = {row.chunk_id: len(row.token_ids) for row, _ in engine.retrieve(question, 3)}
            assert lengths[reuse.sources[0].chunk_id] == max(lengths.values())
            stored = reuse.stats.reused_tokens - reuse.stats.prefix_cache_tokens
            assert stored >= retrieval.stats.reused_tokens - retrieval.stats.prefix_cache_tokens


def test_a_state_is_keyed_by_everything_before_it(family_model, corpus, tmp_path):
    """A recurrent layer's state sums up every token before it: the system prompt, the chunk, and
    in a span the chunks before it. The cache key already chains over all of them: the same chunk
    under another system prompt has another key and another state, and its entry under either key
    holds the state a fresh computation after that prefix gives."""
    from ragkv.kv import codec
    from ragkv.model.forward import compute_chunks, compute_prefix

    folder = str(family_model("qwen3.5 (Gated DeltaNet + full)"))
    stores = {"default": tmp_path / "a", "other": tmp_path / "b"}
    build_store(corpus, stores["default"], folder, chunk_tokens=24)
    build_store(corpus, stores["other"], folder, chunk_tokens=24, system_prompt="Answer in one word.")
    found = {}
    for name, store in stores.items():
        with ragkv.open(store, device="cpu") as engine:
            (row, _), *_ = engine.retrieve(QUESTIONS[0], 1, context="chunk")
            entry = codec.read(engine.snapshot.shards, row.entry, torch.float32)
            prefix = compute_prefix(engine.lm.model, engine.active.profile.prefix_ids)
            (fresh,) = compute_chunks(engine.lm.model, prefix, [list(row.token_ids)], 64, engine.lm.pad_id)
            for state_name, state in entry.state.items():
                torch.testing.assert_close(state, fresh.kv.state[state_name], rtol=1e-5, atol=1e-6)
            found[name] = (row.token_ids, row.entry.kv_key, entry.state)
    (ids_a, key_a, state_a), (ids_b, key_b, state_b) = found["default"], found["other"]
    assert ids_a == ids_b and key_a != key_b  # the same chunk, keyed by the prefix before it
    assert any(not torch.allclose(state_a[n], state_b[n], atol=1e-4) for n in state_a)


@pytest.mark.parametrize("family", SERVED)
def test_the_rerank_scores_a_hybrid_s_candidates_as_full_prefills_do(family, family_store):
    """The rerank scores candidates in batches of different lengths (left-padded KV, each row's own
    state); every candidate scores what a full prefill of its prompt scores."""
    from tests.test_rerank import _context_ids, _full_prefill_likelihood

    with ragkv.open(family_store(family), device="cpu") as engine:
        found = engine.search(QUESTIONS[0], top_k=5, rerank=5)
        assert len(found) == 5 and all(r.likelihood is not None for r in found)
        for result in found:
            ids = _context_ids(engine, result.doc_id, result.chunk_index, span=False)
            assert abs(result.likelihood - _full_prefill_likelihood(engine, ids, QUESTIONS[0])) < 1e-4


def test_a_hybrid_cache_cut_back_with_its_kept_state_continues_as_a_fresh_one(family_model):
    """What a conversation does when it drops old turns: the cache is cut back to its context,
    whose recurrent state was kept when the context was assembled (a state cannot be cut)."""
    from ragkv.kv import cache as kv
    from ragkv.model.generate import prefill

    lm = load_model(str(family_model("nemotron-h (Mamba2 + attention + MLP layers)")), "cpu", "float32")
    context, turn, after = list(range(10, 60)), list(range(200, 230)), list(range(300, 309))
    cache = kv.to_cache_empty(lm.model.config)
    prefill(lm.model, context, cache)
    kept = kv.state_of(cache)
    prefill(lm.model, turn, cache)
    with pytest.raises(ValueError, match="kept"):
        kv.crop(cache, len(context))
    kv.crop(cache, len(context), kept)
    assert kv.num_cached(cache) == len(context)
    fresh = kv.to_cache_empty(lm.model.config)
    prefill(lm.model, context, fresh)
    torch.testing.assert_close(prefill(lm.model, after, cache), prefill(lm.model, after, fresh), rtol=1e-5, atol=1e-5)


def test_a_hybrid_s_missing_chunks_are_computed_with_their_state_and_written_back(family_model, corpus, tmp_path):
    """A store without chunk KV (`--precompute 0`): each chunk a question needs is computed on the
    miss, with the state at its end, answers equal to a full prefill, and written back; the next
    engine reads it from the store and answers the same."""
    store = tmp_path / "lazy"
    build_store(corpus, store, str(family_model("qwen3.5 (Gated DeltaNet + full)")), chunk_tokens=24, precompute=0)
    with ragkv.open(store, device="cpu") as engine:
        first = engine.ask(QUESTIONS[0], top_k=2, max_new_tokens=8)
        full = engine.ask(QUESTIONS[0], top_k=2, max_new_tokens=8, use_cache=False)
        assert first.stats.kv_source == "computed" and first.token_ids == full.token_ids
        engine.flush()
    with ragkv.open(store, device="cpu") as engine:
        again = engine.ask(QUESTIONS[0], top_k=2, max_new_tokens=8)
        assert again.stats.kv_source == "store" and again.token_ids == first.token_ids
