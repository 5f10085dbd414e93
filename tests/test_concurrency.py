"""A reader process asks in a loop while this process re-indexes (and gcs) the store: no
read fails, every answer is cached, and every answer comes from one generation's content."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import ragkv
from ragkv.config import ModelSettings
from store import collect_garbage
from tests.conftest import ROOT

READER = textwrap.dedent("""
    import json, os, re, sys
    sys.path.insert(0, {root!r})
    import ragkv
    engine = ragkv.open({store!r}, device="cpu")
    print("READY", flush=True)
    with open({log!r}, "w") as log:
        while not os.path.exists({stop!r}):
            try:
                engine.refresh()
                answer = engine.ask("When does service 3 deploy?", max_new_tokens=2)
                prompt = engine.lm.tokenizer.decode(answer.prompt_ids)
                version = re.search(r"version (\\d+)", prompt)
                record = {{"generation": answer.stats.store_generation, "version": int(version.group(1)),
                          "mode": answer.stats.mode, "reused": answer.stats.reused_tokens}}
            except Exception as exc:
                record = {{"error": repr(exc)}}
            log.write(json.dumps(record) + "\\n")
            log.flush()
""")


def write_docs(folder, version: int) -> None:
    for i in range(6):
        (folder / f"service-{i}.md").write_text(
            f"Release train version {version}: service {i} deploys at {i}:00 and is owned by team {i % 2}."
        )


def test_reader_sees_whole_generations_while_the_store_is_reindexed(tiny_llama, tmp_path):
    docs, store = tmp_path / "docs", tmp_path / "store"
    docs.mkdir()
    model = ModelSettings(model=str(tiny_llama), device="cpu")
    write_docs(docs, 0)
    versions = {ragkv.ingest([docs], store, model=model).generation: 0}
    script = READER.format(root=str(ROOT), store=str(store), log=str(tmp_path / "log"), stop=str(tmp_path / "stop"))
    reader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "READY"
    for version in range(1, 9):
        write_docs(docs, version)
        versions[ragkv.ingest([docs], store, model=model, prune=True).generation] = version
        if version % 2 == 0:  # gc publishes a generation with the same content, and deletes dead shards
            versions[collect_garbage(store).generation] = version
    (tmp_path / "stop").touch()
    assert reader.wait(timeout=120) == 0

    records = [json.loads(line) for line in (tmp_path / "log").read_text().splitlines()]
    assert not [r for r in records if "error" in r]
    assert len(records) >= 20, len(records)
    assert all(r["mode"] == "exact" and r["reused"] > 0 for r in records)
    assert all(versions[r["generation"]] == r["version"] for r in records)
    assert len({r["generation"] for r in records}) >= 3  # the reader really followed the re-index
