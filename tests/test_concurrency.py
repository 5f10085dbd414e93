"""A reader process asks in a loop while this process re-indexes (and gcs) the store: no
read fails, every answer is cached, every answer comes from one generation's content, and the
reader follows every generation published.

Nothing here waits on the clock. The reader says on its stdout which generation each answer
came from when it changes, and the writer waits for the reader to have seen each generation
before it publishes the next (so the reader really asks while the store is re-indexed, on a
machine of any speed). The reader's loop is bounded by a number of iterations, not seconds;
it checks the stop file between iterations and acknowledges it, and the writer waits for the
acknowledgement. A failed read is said at once (`FAILED ...`) and ends the reader, so the
writer fails with it instead of waiting. Each iteration's seconds are logged, for the failure
message. (This test found a real hang: the reader spinning in DuckDB's `ATTACH IF NOT EXISTS`
when it switched generations; tests/test_segments.py reproduces that alone.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import ragkv
from ragkv.core.config import ModelSettings
from ragkv.store import collect_garbage
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # readers and writers in several processes

ITERATIONS = 20_000  # the reader's bound: far more than the re-index needs
READER = textwrap.dedent("""
    import json, os, re, sys, time
    sys.path.insert(0, {root!r})
    import ragkv
    engine = ragkv.open({store!r}, device="cpu")
    print("READY", flush=True)
    seen = None
    with open({log!r}, "w") as log:
        for iteration in range({iterations}):
            if os.path.exists({stop!r}):
                print(f"STOPPED {{iteration}}", flush=True)
                break
            began = time.perf_counter()
            try:
                engine.refresh()
                answer = engine.ask("When does service 3 deploy?", max_new_tokens=2)
                prompt = engine.lm.tokenizer.decode(answer.prompt_ids)
                version = re.search(r"version (\\d+)", prompt)
                record = {{"generation": answer.stats.store_generation, "version": int(version.group(1)),
                          "mode": answer.stats.mode, "reused": answer.stats.reused_tokens}}
            except Exception as exc:
                record = {{"error": repr(exc)}}
            record["seconds"] = round(time.perf_counter() - began, 3)
            log.write(json.dumps(record) + "\\n")
            log.flush()
            if "error" in record:  # say it and stop: the writer fails at once, not after its hang guard
                print(f"FAILED {{record['error']}}", flush=True)
                break
            if record.get("generation") != seen:
                seen = record.get("generation")
                print(f"SAW {{seen}}", flush=True)
        else:
            print("EXHAUSTED", flush=True)
""")


def write_docs(folder, version: int) -> None:
    for i in range(6):
        (folder / f"service-{i}.md").write_text(
            f"Release train version {version}: service {i} deploys at {i}:00 and is owned by team {i % 2}."
        )


def test_reader_sees_whole_generations_while_the_store_is_reindexed(tiny_llama, tmp_path):
    docs, store, log = tmp_path / "docs", tmp_path / "store", tmp_path / "log"
    docs.mkdir()
    model = ModelSettings(model=str(tiny_llama), device="cpu")
    write_docs(docs, 0)
    versions = {ragkv.ingest([docs], store, model=model).generation: 0}
    script = READER.format(
        root=str(ROOT), store=str(store), log=str(log), stop=str(tmp_path / "stop"), iterations=ITERATIONS
    )
    reader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    said: list[str] = []

    def wait_until_seen(generation: int) -> None:
        """Read the reader's lines until it has answered from `generation` (or a later one)."""
        while not any(line.startswith("SAW ") and line[4:] != "None" and int(line[4:]) >= generation for line in said):
            line = reader.stdout.readline().strip()
            assert line, f"the reader ended before it saw generation {generation}: {said}"
            assert line != "EXHAUSTED", f"the reader ran {ITERATIONS} iterations without the stop: {said}"
            assert not line.startswith("FAILED"), f"a read failed before generation {generation}: {said + [line]}"
            said.append(line)

    try:
        assert reader.stdout.readline().strip() == "READY"
        wait_until_seen(max(versions))
        for version in range(1, 9):
            write_docs(docs, version)
            generation = ragkv.ingest([docs], store, model=model, prune=True).generation
            versions[generation] = version
            if version % 2 == 0:  # gc publishes a generation with the same content, and deletes dead shards
                generation = collect_garbage(store).generation
                versions[generation] = version
            wait_until_seen(generation)
        (tmp_path / "stop").touch()
        while not said[-1].startswith("STOPPED"):  # the reader's acknowledgement, not a number of seconds
            said.append(reader.stdout.readline().strip())
            assert said[-1], f"the reader ended without acknowledging the stop: {said}"
    finally:
        (tmp_path / "stop").touch()
        try:
            code = reader.wait(timeout=600)  # a hang guard only: the reader has acknowledged the stop
        except subprocess.TimeoutExpired:
            reader.kill()
            reader.wait()
            raise
    assert code == 0

    records = [json.loads(line) for line in log.read_text().splitlines()]
    slowest = sorted(records, key=lambda r: -r["seconds"])[:5]
    assert not [r for r in records if "error" in r], slowest
    assert all(r["mode"] == "exact" and r["reused"] > 0 for r in records)
    assert all(versions[r["generation"]] == r["version"] for r in records)
    answered_from = {r["generation"] for r in records}
    # The first generation and each re-index's last: the writer waited for the reader to see each.
    assert max(versions) in answered_from and len(answered_from) >= 1 + 8, (sorted(answered_from), sorted(versions))
