"""`RaggedBatch`, the rows of continuous batching: whatever joins, leaves, or makes the
buffers grow, every row's logits equal those of the same sequence decoded alone (float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ragkv.kv import cache as kv
from ragkv.kv.packed import packable
from ragkv.kv.ragged import RaggedBatch
from ragkv.model.generate import prefill


@pytest.fixture(scope="module")
def model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


class Alone:
    """One sequence decoded by itself over a batch-1 cache: the reference for its row."""

    def __init__(self, model, length: int, seed: int, *prompt: list[int]):
        """`length` random ids (of `seed`), or the ids of `prompt`'s parts prefilled one after another."""
        generator = torch.Generator().manual_seed(seed)
        self.model = model
        self.cache = kv.to_cache_empty(model.config)
        for ids in prompt or [torch.randint(3, 200, (length,), generator=generator).tolist()]:
            self.logits = prefill(model, ids, self.cache)
        self.token = int(self.logits.argmax())

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        ids = torch.tensor([[self.token]])
        self.logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        return self.logits


def _step_all(model, batch: RaggedBatch, rows: list[Alone]) -> None:
    with torch.inference_mode():
        logits = batch.step(model, [row.token for row in rows])  # (B, V)
    for i, row in enumerate(rows):
        expected = row.step()
        torch.testing.assert_close(logits[i], expected, rtol=1e-5, atol=1e-5)
        assert int(logits[i].argmax()) == int(expected.argmax())
        row.token = int(expected.argmax())


def test_rows_that_join_leave_and_outgrow_the_buffers_each_decode_as_alone(model):
    batch = RaggedBatch(model.config)
    rows: list[Alone] = []
    lengths = [5, 40, 17, 3, 60, 9]  # the 5th row is wider than the buffers were made for
    for seed, length in enumerate(lengths):
        rows.append(Alone(model, length, seed))
        assert batch.add(rows[-1].cache) == len(rows) - 1  # also more rows than the first capacity
        _step_all(model, batch, rows)
    assert batch.lengths == [r.cache.get_seq_length() for r in rows]

    order = batch.remove([1, 4])  # the last rows move into the holes
    assert sorted(order) == [0, 2, 3, 5] and len(order) == 4
    rows = [rows[i] for i in order]
    assert batch.width == max(r.cache.get_seq_length() for r in rows)
    for _ in range(3):
        _step_all(model, batch, rows)

    rows.append(Alone(model, 200, seed=99))  # longer than every column reserved so far
    batch.add(rows[-1].cache)
    for _ in range(90):  # past the spare columns: the buffers grow mid-decode
        _step_all(model, batch, rows)
    rows.append(Alone(model, 7, seed=100))  # joins buffers that a step (in inference mode) made
    batch.add(rows[-1].cache)
    _step_all(model, batch, rows)

    for i, row in enumerate(rows):  # a row taken out holds its own tokens (the batched projections
        out = batch.extract(i)  # may differ from lone ones in the last float bits)
        assert out.get_seq_length() == row.cache.get_seq_length()
        torch.testing.assert_close(kv.from_cache(out).kv, kv.from_cache(row.cache).kv, rtol=1e-5, atol=1e-5)
    assert batch.remove(list(range(len(rows)))) == []
    assert batch.num_rows == 0 and batch.cache is None


def test_a_growing_cache_appends_in_place_and_survives_a_crop(model):
    cache = kv.to_cache_empty(model.config)
    prefill(model, list(range(3, 30)), cache)
    layer = cache.layers[0]
    before = layer.keys.data_ptr()
    prefill(model, [7], cache)
    assert layer.keys.data_ptr() == before  # written into the spare room, not a new tensor
    kv.crop(cache, 20)
    prefill(model, [8, 9], cache)
    assert cache.get_seq_length() == 22

    reference = kv.to_cache_empty(model.config)
    prefill(model, list(range(3, 23)) + [8, 9], reference)
    torch.testing.assert_close(kv.from_cache(cache).kv, kv.from_cache(reference).kv, rtol=1e-5, atol=1e-5)


def test_a_packed_step_feeds_a_prompt_beside_the_decoding_rows_each_as_alone(model):
    """The packed step (ragkv.kv.packed): decoding rows one token each and a joining row its
    prompt's chunk, in one forward; every row's logits equal its own sequence run alone, in
    that step and the steps after, and the buffers grow past their spare columns meanwhile."""
    assert packable(model)
    batch = RaggedBatch(model.config)
    rows = [Alone(model, length, seed) for seed, length in enumerate([30, 8, 55])]
    for row in rows:
        batch.add(row.cache)
    generator = torch.Generator().manual_seed(7)
    for length, chunk in [(12, 9), (70, 200)]:  # a prompt's context, then its chunk: the second outgrows the buffers
        context = torch.randint(3, 200, (length,), generator=generator).tolist()
        question = torch.randint(3, 200, (chunk,), generator=generator).tolist()
        joining = kv.to_cache_empty(model.config)
        prefill(model, context, joining)
        batch.add(joining)  # its row joins holding the context; the question goes in with the step
        alone = Alone(model, 0, 0, context, question)
        with torch.inference_mode():
            logits = batch.step_packed(model, [[row.token] for row in rows] + [question])
        for i, row in enumerate(rows):
            torch.testing.assert_close(logits[i], row.step(), rtol=1e-5, atol=1e-5)
            row.token = int(row.logits.argmax())
        torch.testing.assert_close(logits[-1], alone.logits, rtol=1e-5, atol=1e-5)
        rows.append(alone)
        for _ in range(3):
            with torch.inference_mode():
                logits = batch.step_packed(model, [[row.token] for row in rows])
            for i, row in enumerate(rows):
                expected = row.step()
                torch.testing.assert_close(logits[i], expected, rtol=1e-5, atol=1e-5)
                row.token = int(expected.argmax())
    assert batch.lengths == [r.cache.get_seq_length() for r in rows]
    # Handed back: a cache holding a row's first 5 tokens grows by the rest, as the batch computed them.
    for i, row in enumerate(rows):
        cache = batch.hand_back(i, kv.to_cache([kv.from_cache(row.cache, 0, 0, 5)], model.config))
        assert cache.get_seq_length() == row.cache.get_seq_length()
        torch.testing.assert_close(kv.from_cache(cache).kv, kv.from_cache(row.cache).kv, rtol=1e-5, atol=1e-5)
