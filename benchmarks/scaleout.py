"""Scale-out, side by side in one run on the sample corpus and the bundled SmolLM2 (float32, CPU):

- ingest: the local engine vs `--engine ray` with 1 and 2 workers (a local Ray started once,
  beforehand; its start-up is reported apart). Wall time of the whole ingest and tokens/s.
- an S3 store (SeaweedFS `weed mini` on loopback) vs a local folder: ingest time, and time to
  first token of the same questions from a cold cache (shards fetched) and a warm one.

    python benchmarks/scaleout.py [--out benchmarks/results/scaleout.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import IngestSettings, ModelSettings, cache_dir  # noqa: E402
from ragkv.store.remote import RemoteStore  # noqa: E402
from tests import s3server  # noqa: E402

QUESTIONS = (Path(__file__).parent / "questions.txt").read_text().splitlines()[:5]
MODEL = ModelSettings(model="smollm2", device="cpu", dtype="float32")
DATA = ROOT / "data"
MODELS = cache_dir() / "models"


def timed_ingest(store, engine: str = "ragkv", workers: int = 0) -> tuple[float, dict]:
    started = time.perf_counter()
    report = ragkv.ingest(DATA, store, model=MODEL, settings=IngestSettings(), engine=engine, workers=workers)
    return time.perf_counter() - started, report.to_dict()


def ttfts(store) -> list[float]:
    with ragkv.open(store, device="cpu") as engine:
        return [engine.ask(q, max_new_tokens=1).stats.ttft_s for q in QUESTIONS]


def fresh_home(home: Path) -> None:
    """An empty ragkv cache (the converted model linked, not converted again)."""
    home.mkdir()
    (home / "models").symlink_to(MODELS)
    os.environ["RAGKV_HOME"] = str(home)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scaleout.md")
    args = parser.parse_args()
    import ray

    work = Path(tempfile.mkdtemp(prefix="ragkv-scaleout-"))
    ray_started = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    ray_start_s = time.perf_counter() - ray_started

    timed_ingest(work / "warm-up")  # first model load, fingerprints, imports: not counted
    rows = []
    for engine, workers in (("ragkv", 0), ("ray", 1), ("ray", 2)):
        seconds, report = timed_ingest(work / f"{engine}-{workers}", engine, workers)
        rows.append((engine, workers, seconds, report))
        print(engine, workers, f"{seconds:.1f} s", report["tokens_computed"], "tokens", flush=True)
    ray.shutdown()
    base = rows[0][2]

    with s3server.s3_server(work / "weed") as endpoint:
        os.environ.update(s3server.environment(endpoint))
        local_seconds, _ = timed_ingest(work / "local-again")  # side by side with the S3 ingest
        fresh_home(work / "writer")  # no mirror left by an earlier run (its shards would be adopted)
        s3_seconds, _ = timed_ingest("s3://ragkv/bench")
        local_first = ttfts(work / "local-0")[0]  # a new process's first question: warm-up included
        local_ttft = statistics.median(ttfts(work / "local-0"))
        fresh_home(work / "reader")  # another machine: an empty cache
        cold = ttfts("s3://ragkv/bench")
        shards = RemoteStore("s3://ragkv/bench").mirror / "shards"
        while not list(shards.glob("*.safetensors")):  # the background copy: warm reads are local
            time.sleep(0.1)
        warm = statistics.median(ttfts("s3://ragkv/bench"))
    print("s3", f"{s3_seconds:.1f} s", cold, warm, local_ttft)

    cpu = describe()
    lines = [
        "# Scale-out: the Ray engine and an S3 store",
        "",
        f"Sample corpus (`data/`, {rows[0][3]['tokens_computed']:,} tokens of KV), bundled SmolLM2-135M float32 on "
        f"CPU ({cpu}), one run side by side. Command: `python benchmarks/scaleout.py`.",
        "",
        "## Ingest engines",
        "",
        f"Local Ray started beforehand in {ray_start_s:.1f} s (not counted below).",
        "",
        "| engine | workers | ingest s | tokens/s (whole ingest) | vs local |",
        "|---|---|---|---|---|",
    ]
    for engine, workers, seconds, report in rows:
        lines.append(
            f"| {engine} | {workers or '-'} | {seconds:.1f} | {report['tokens_computed'] / seconds:,.0f} | "
            f"{base / seconds:.2f}x |"
        )
    lines += [
        "",
        "On 2 cores Ray cannot win: the local engine already runs the model on both cores, while each Ray",
        "worker is a separate process that loads its own copy of the model and embedder (start-up inside",
        "the job), gets a share of the cores, and ships rows through Ray's object store. Ray pays off when",
        "workers add hardware: one actor per GPU (`num_gpus=1`), each computing KV independently, shards",
        "written straight to shared or object storage, the driver only committing catalog rows.",
        "",
        "## S3 store (SeaweedFS on loopback) vs a local folder",
        "",
        "| | local folder | S3 |",
        "|---|---|---|",
        f"| ingest s (local engine) | {local_seconds:.1f} | {s3_seconds:.1f} ({s3_seconds / local_seconds:.2f}x the time) |",
        f"| TTFT of a new engine's first question s (S3: empty cache) | {local_first:.3f} | {cold[0]:.3f} |",
        f"| TTFT median, {len(QUESTIONS)} questions, warm s | {local_ttft:.3f} | {warm:.3f} ({warm / local_ttft:.2f}x) |",
        "",
        "A cold reader copies the catalog and index down on open; a shard's first read fetches only the",
        "entry's bytes (ranged GETs) while the whole shard is copied down in the background (the sample",
        "corpus fits one shard); once copied, every read is a local `pread`.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
