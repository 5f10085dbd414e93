"""Several chunks per question: exact (with the in-process prefix cache), concat and blend."""

from __future__ import annotations

import threading

import pytest
import torch

import ragkv
from ragkv.core.config import DecodeSettings
from ragkv.core.errors import InputError, ModelError
from ragkv.core.keys import KVKey
from ragkv.kv.entry import Entry
from ragkv.kv.rope import check_supported, shift_positions
from ragkv.model.forward import compute_chunks, compute_prefix
from ragkv.modes.prefix_cache import PrefixCache
from tests.conftest import QUESTIONS


def logit_gap(engine, question, **options) -> float:
    approx = engine.first_token_logits(question, **options)
    full = engine.first_token_logits(question, top_k=options.get("top_k", 1), use_cache=False)
    return (approx - full).abs().max().item()


def random_llama(num_layers: int):
    """(model, config): a small Llama of random weights (seeded), for checks on the model's own numbers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval(), config


def test_exact_reuses_a_repeated_chunk_combination_from_the_prefix_cache(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        first = engine.ask(QUESTIONS[0], top_k=3, max_new_tokens=8)
        again = engine.ask(QUESTIONS[0], top_k=3, max_new_tokens=8)
        full = engine.ask(QUESTIONS[0], top_k=3, max_new_tokens=8, use_cache=False)
    assert first.stats.prefix_cache_tokens == 0 and again.stats.prefix_cache_tokens > 0
    assert again.stats.reused_tokens == first.stats.reused_tokens + again.stats.prefix_cache_tokens
    assert again.stats.computed_tokens < first.stats.computed_tokens
    assert first.token_ids == again.token_ids == full.token_ids


def test_a_question_asked_again_over_the_same_context_prefills_only_its_last_token(tiny_store):
    """The question's KV is kept after its answer (in the prefix cache, after its context's
    chain): asked again, alone or in a batch, only its last token is prefilled, and the answer
    and the first token's logits equal a full prefill's. Another question, or the same one over
    another context, prefills its question."""
    question = QUESTIONS[1]
    with ragkv.open(tiny_store, device="cpu") as engine:
        for top_k in (1, 3):  # the question after the first chunk, and after chunks from the prefix cache
            first = engine.ask(question, top_k=top_k, max_new_tokens=8)
            again = engine.ask(question, top_k=top_k, max_new_tokens=8)
            full = engine.ask(question, top_k=top_k, max_new_tokens=8, use_cache=False)
            assert first.stats.computed_tokens > 1 and again.stats.computed_tokens == 1
            assert again.stats.reused_tokens == len(again.prompt_ids) - 1
            assert first.token_ids == again.token_ids == full.token_ids
            cached = engine.first_token_logits(question, top_k=top_k)
            assert (cached - engine.first_token_logits(question, top_k=top_k, use_cache=False)).abs().max() < 1e-4
        with engine.batched() as batcher:  # kept from inside a batch too
            batched = [batcher.ask(q, max_new_tokens=8) for q in (QUESTIONS[2], QUESTIONS[2])]
        assert batched[0].stats.computed_tokens > 1 and batched[1].stats.computed_tokens == 1
        assert batched[0].token_ids == batched[1].token_ids
        assert engine.ask(QUESTIONS[3], max_new_tokens=2).stats.computed_tokens > 1


def test_shifting_keys_matches_computing_them_at_the_new_position(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    chunk = [504, 3458, 314, 18208, 30, 2683, 359]
    prefix = compute_prefix(model, [1, 9690, 198])
    longer = compute_prefix(model, [1, 9690, 198, 4093, 198, 17548, 42])  # 4 tokens more before the chunk
    (at_3,) = compute_chunks(model, prefix, [chunk], 64, 2)
    (at_7,) = compute_chunks(model, longer, [chunk], 64, 2)
    moved = shift_positions(at_3.kv.kv, 4, model)
    assert torch.allclose(moved[0, 0], at_7.kv.kv[0, 0], atol=1e-5)  # layer 0 keys: exact
    assert torch.equal(moved[:, 1], at_3.kv.kv[:, 1])  # values carry no position
    assert not torch.allclose(moved[1, 0], at_7.kv.kv[1, 0], atol=1e-5)  # deeper layers saw other tokens


def test_concat_of_one_chunk_is_exact_and_blend_of_everything_is_a_full_prefill(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        for question in QUESTIONS[:2]:
            assert logit_gap(engine, question, mode="concat") < 1e-4
            assert logit_gap(engine, question, mode="blend", top_k=3, blend_ratio=1.0) < 1e-4
            assert logit_gap(engine, question, mode="epic", top_k=3, blend_ratio=1.0) < 1e-4
            assert logit_gap(engine, question, mode="query", top_k=3, blend_ratio=1.0) < 1e-4
            assert logit_gap(engine, question, mode="concat", top_k=3) > 1e-3  # approximate, for real


def test_ape_without_temperature_or_scaling_is_concat_and_with_them_attends_differently(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        question = QUESTIONS[0]
        concat = engine.first_token_logits(question, mode="concat", top_k=3)
        plain = engine.first_token_logits(question, mode="ape", top_k=3, ape_temperature=1.0, ape_scale=1.0)
        scaled = engine.first_token_logits(question, mode="ape", top_k=3, ape_temperature=0.5, ape_scale=1.5)
        assert (plain - concat).abs().max().item() < 1e-4
        assert (scaled - concat).abs().max().item() > 1e-3
        again = engine.first_token_logits(question, mode="concat", top_k=3)  # the model attends as before
        assert torch.equal(again, concat)


def test_ape_attends_the_same_in_a_conversation_and_beside_other_rows(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        alone = engine.ask(QUESTIONS[0], mode="ape", top_k=3, ape_scale=0.5, max_new_tokens=6)
        chat = engine.conversation(mode="ape", top_k=3, ape_scale=0.5, max_new_tokens=6)
        assert chat.ask(QUESTIONS[0]).token_ids == alone.token_ids
        assert chat.attention is not None and chat.ask(QUESTIONS[1]).text is not None  # a later turn attends as well
        plain = engine.ask(QUESTIONS[1], top_k=2, max_new_tokens=6)
        gate = threading.Event()
        with engine.batched() as batcher:
            blocker = batcher.engine.call_soon(gate.wait)  # holds the steps: both turns join in the same one
            scaled = batcher.engine.submit(
                lambda: engine.conversation(mode="ape", top_k=3, ape_scale=0.5), QUESTIONS[0], 6, DecodeSettings()
            )
            beside = batcher.engine.submit(lambda: engine.conversation(top_k=2), QUESTIONS[1], 6, DecodeSettings())
            gate.set()
            blocker.result()
            # One decodes in forwards of its own, the other in the batch; each as alone (float32).
            assert scaled.result().token_ids == alone.token_ids
            assert beside.result().token_ids == plain.token_ids
            assert scaled.result().stats.batch_size == beside.result().stats.batch_size == 2


def test_blend_narrows_its_selection_layer_by_layer():
    from ragkv.modes.blend import _narrowing

    assert _narrowing(10, 100, 5) == [20, 18, 15, 12, 10]
    assert _narrowing(10, 15, 3) == [15, 12, 10]  # never more than there is
    assert _narrowing(100, 100, 4) == [100] * 4  # everything: a full recompute at every layer


def test_blend_repairs_the_tokens_it_selects_and_everything_at_ratio_one():
    from ragkv.kv import cache as kv
    from ragkv.modes.blend import blend

    model, config = random_llama(num_layers=6)
    ids, start = list(range(3, 63)), 20  # 60 tokens; the first 20 stay as they are

    def full_and_damaged():
        full = kv.to_cache_empty(config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]), cache=full, use_cache=True)
        exact = kv.from_cache(full).kv  # (L, 2, H, T, D)
        damaged = exact.clone()
        damaged[2:, :, :, start:] += 0.5 * torch.randn_like(damaged[2:, :, :, start:])  # past the selection layers
        return exact, damaged, kv.to_cache([Entry.of(damaged)], config)

    exact, _, cache = full_and_damaged()
    assert blend(model, cache, ids, start, 1.0).num_recomputed == 40
    assert torch.allclose(kv.from_cache(cache).kv, exact, atol=1e-5)

    exact, damaged, cache = full_and_damaged()
    result = blend(model, cache, ids, start, 0.25)
    assert 10 < result.num_recomputed < 20  # per layer, from 20 at layer 2 down to 10 at the last
    repaired = kv.from_cache(cache).kv
    assert torch.equal(repaired[:, :, :, :start], exact[:, :, :, :start])
    for layer, count in ((2, 20), (5, 10)):  # the first layer past the selection ones, and the last
        changed = (repaired[layer] != damaged[layer]).any(dim=(0, 1, 3))  # (T,) tokens recomputed there
        assert changed.sum() == count and not changed[:start].any()
        error = (repaired[layer] - exact[layer]).abs().amax(dim=(0, 1, 3))
        before = (damaged[layer] - exact[layer]).abs().amax(dim=(0, 1, 3))
        assert (error[changed] < before[changed] / 2).all()  # nearer a full prefill (the rest of the context is not)


@pytest.mark.parametrize("mode", ["concat", "blend", "epic", "query", "ape", "approximate"])
def test_approximate_modes_answer_and_say_what_they_did(tiny_store, mode):
    engine = ragkv.open(tiny_store, device="cpu")
    answer = engine.ask(QUESTIONS[0], top_k=3, mode=mode, max_new_tokens=6)
    if mode not in ("concat", "ape"):
        assert engine.ask(QUESTIONS[0], top_k=1, mode=mode, max_new_tokens=2).stats.recomputed_tokens == 0
    stats = answer.stats
    if mode == "approximate":  # this store was never calibrated: the default, said to be unmeasured
        assert stats.approximation == "query 20%, uncalibrated" and "not calibrated" in stats.warnings[0]
        mode = "query"
    assert stats.mode == mode and len(answer.sources) == 3
    assert answer.to_dict()["stats"]["approximate"] is True
    assert engine.ask(QUESTIONS[0], top_k=3, max_new_tokens=1).to_dict()["stats"]["approximate"] is False
    assert stats.reused_tokens + stats.recomputed_tokens + stats.computed_tokens == len(answer.prompt_ids)
    context = len(answer.prompt_ids) - stats.computed_tokens
    first_chunk = len(
        engine.snapshot.catalog.entries.context_rows(engine.active.profile.profile_id, [answer.sources[0].chunk_id])[
            0
        ].token_ids
    )
    if mode == "blend":  # this model has only the 2 selection layers, computed exactly for every token
        assert stats.recomputed_tokens == context - len(engine.active.layout.prefix_ids) - first_chunk
    elif mode == "epic":  # the first 5% by default (at least one token) of each later chunk, its separator included
        rows = engine.snapshot.catalog.entries.context_rows(
            engine.active.profile.profile_id, [s.chunk_id for s in answer.sources[1:]]
        )
        separator = len(engine.active.layout.separator_ids)
        assert stats.recomputed_tokens == sum(max(1, round(0.05 * (separator + len(r.token_ids)))) for r in rows)
    elif mode == "query":  # 20% by default of the tokens after the first chunk
        assert stats.recomputed_tokens == max(
            1, round(0.2 * (context - len(engine.active.layout.prefix_ids) - first_chunk))
        )
    else:
        assert stats.recomputed_tokens == 0
    engine.close()


def test_the_query_recompute_in_the_prefill_equals_recomputing_then_prefilling():
    """`query` recomputes its chosen context tokens in the question's own prefill: one forward
    gives the logits and the cache that recomputing first and prefilling after give."""
    from ragkv.kv import cache as kv
    from ragkv.model.generate import prefill
    from ragkv.modes.blend import Recompute, _recompute

    model, config = random_llama(num_layers=4)
    context, question = list(range(3, 53)), [60, 61, 62, 63, 64, 65]
    full = kv.to_cache_empty(config)
    prefill(model, context, full)
    damaged = kv.from_cache(full).kv
    damaged[1:, :, :, 10:] += 0.5 * torch.randn_like(damaged[1:, :, :, 10:])  # as concatenated chunks' KV
    positions = torch.tensor([12, 20, 21, 33, 49])

    two_passes = kv.to_cache([Entry.of(damaged)], config)
    with torch.inference_mode():
        _recompute(model, two_passes, torch.tensor([context]), positions)
    want = prefill(model, question, two_passes)

    one_pass = kv.to_cache([Entry.of(damaged)], config)
    got = prefill(model, question, one_pass, Recompute(positions, torch.tensor(context)[positions], len(context)))
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(kv.from_cache(one_pass).kv, kv.from_cache(two_passes).kv, atol=1e-5)
    assert not torch.allclose(got, prefill(model, question, kv.to_cache([Entry.of(damaged)], config)), atol=1e-3)


def test_the_attention_probe_measures_without_changing_the_forward(tiny_store):
    from ragkv.kv import cache as kv
    from ragkv.model.generate import prefill
    from ragkv.modes.attention_probe import Probe, probed_forward

    with ragkv.open(tiny_store, device="cpu") as engine:
        model, config = engine.lm.model, engine.lm.model.config
        context, question = list(range(5, 45)), list(range(50, 58))
        plain, probed = kv.to_cache_empty(config), kv.to_cache_empty(config)
        prefill(model, context, plain)
        prefill(model, context, probed)
        want = prefill(model, question, plain)
        probe = Probe(len(context))
        ids = torch.tensor([question])
        with torch.inference_mode():
            got = probed_forward(model, probe, input_ids=ids, cache=probed, use_cache=True, logits_to_keep=1).logits[
                0, -1
            ]
    assert torch.allclose(got, want, atol=1e-5)
    # every layer, head and question token spreads one unit of attention over the context
    heads = config.num_attention_heads * config.num_hidden_layers
    assert probe.mass.shape == (len(context),) and abs(probe.mass.sum().item() - heads * len(question)) < 1e-2


def test_unsupported_rotary_embeddings_are_refused(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.config.rope_parameters = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ModelError, match="Use --mode exact"):
        check_supported(model)


def test_bad_options_are_named(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        with pytest.raises(InputError, match="unknown --mode 'fast'"):
            engine.ask("hi", mode="fast")
        answer = engine.ask(QUESTIONS[0], top_k=50, max_new_tokens=2)
        assert len(answer.sources) == 6 and "store holds 6 chunks" in answer.stats.warnings[0]


def test_prefix_cache_evicts_by_bytes_and_verifies_tokens():
    cache = PrefixCache(max_bytes=3 * 400)
    kv = lambda: torch.zeros(1, 2, 1, 10, 5)  # noqa: E731 - 400 bytes
    root, other = KVKey("p", "root"), KVKey("p", "other")
    cache.insert(root, [[1], [2], [3]], [kv(), kv(), kv()])
    assert cache.match(root, [[1], [2], [3]]).num_segments == 3
    cache.insert(other, [[9]], [kv()])  # evicts the least recently used
    assert cache.bytes <= 1200 and len(cache) == 3
    assert cache.match(root, [[1], [2]]).num_segments == 0  # [1] was evicted: the chain breaks there
    assert cache.match(other, [[9]]).num_segments == 1
    assert cache.match(root, [[1], [2], [4]]).num_segments == 0


def test_too_many_chunks_for_the_context_are_trimmed_and_said(tiny_llama, tmp_path):
    from tests.conftest import build_store

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"long-{i}.md").write_text(" ".join(f"Line {j} of manual {i} covers valve {j}." for j in range(200)))
    build_store(docs, tmp_path / "s", str(tiny_llama), chunk_tokens=400)
    with ragkv.open(tmp_path / "s", device="cpu") as engine:
        answer = engine.ask("Which manual covers valve 7?", top_k=4, max_new_tokens=4)
        full = engine.ask("Which manual covers valve 7?", top_k=4, max_new_tokens=4, use_cache=False)
    assert len(answer.sources) < 4 and any("context cut from 4 to" in w for w in answer.stats.warnings)
    assert len(answer.prompt_ids) + 16 <= engine.lm.facts.max_context
    assert answer.token_ids == full.token_ids


def test_the_ram_tier_serves_hot_chunks_and_evicts_by_bytes(tiny_store):
    from ragkv.core.lru import ByteLRU

    with ragkv.open(tiny_store, device="cpu") as engine:
        first = engine.ask(QUESTIONS[0], max_new_tokens=6)
        again = engine.ask(QUESTIONS[0], max_new_tokens=6)
        assert (first.stats.ram_misses, first.stats.ram_hits) == (1, 0)
        assert (again.stats.ram_misses, again.stats.ram_hits) == (0, 1)
        assert again.token_ids == first.token_ids
        one_chunk = engine.ram.bytes
        engine.ram = ByteLRU(int(one_chunk * 1.5))  # room for one or two chunks
        for question in QUESTIONS:  # four different chunks
            engine.ask(question, max_new_tokens=1)
        assert engine.ram.bytes <= 1.5 * one_chunk and len(engine.ram) < 4
        assert engine.ask(QUESTIONS[-1], max_new_tokens=1).stats.ram_hits == 1  # the most recent stays


def test_byte_lru_keeps_the_most_recent_within_its_budget():
    from ragkv.core.lru import ByteLRU

    lru = ByteLRU(max_bytes=1000)
    for name in "abc":
        lru.put(name, torch.zeros(100))  # 400 bytes each
    assert len(lru) == 2 and "a" not in lru and lru.bytes == 800
    assert lru.get("b") is not None and lru.get("a") is None
    lru.put("d", torch.zeros(100))  # evicts c: b was used more recently
    assert "c" not in lru and "b" in lru
    lru.put("huge", torch.zeros(1000))  # larger than the budget: not kept, nothing evicted
    assert "huge" not in lru and len(lru) == 2
    assert lru.stats()["hits"] == 1 and lru.stats()["misses"] == 1
