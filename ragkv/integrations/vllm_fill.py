"""The KV half of `ragkv ingest --engine vllm`, run in a python that has vLLM (ingest starts it):
vLLM's offline engine prefills the system prefix plus each sequence ingest planned (a chunk
alone, or a span's chunks from its start, separators between), and the ragkv connector saves
each chunk the store lacks from vLLM's blocks into the store's shards and catalog, under the
key ingest gives it (see ragkv.integrations.vllm). Prints one line `RESULT {json}` at the end.

    python -m ragkv.integrations.vllm_fill STORE MODEL_FOLDER DTYPE UNITS_JSON [VLLM_ARGS_JSON]

UNITS_JSON: a file holding a list of sequences, each `{"chunks": [[chunk_id, num_tokens], ...],
"ids": [...]}` (`ids`: the sequence's token ids after the prefix). The sequences go to vLLM
all at once, so its scheduler batches them as it batches requests; saves wait for room in the
write-back instead of being dropped, and are not logged as uses.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker's connector in this process: to flush it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of paged KV on a CPU build
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from ragkv.integrations.store_match import PARAMS_KEY, ModelIdentity, profile_for

    store, model, dtype = sys.argv[1:4]
    units = json.loads(Path(sys.argv[4]).read_text())
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    started = time.perf_counter()
    identity = ModelIdentity.of_folder(model, dtype)
    profile = profile_for(store, identity)
    result: dict[str, float] = {
        "chunks": sum(len(u["chunks"]) for u in units),
        "tokens": sum(len(u["ids"]) for u in units),
        "stored": 0,
    }
    if units:
        config = KVTransferConfig(
            kv_connector="RagkvConnector",
            kv_connector_module_path="ragkv.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"store": store, "wait_saves": True, "log_uses": False, "writer": True},
        )
        llm = LLM(
            model=model,
            dtype=dtype,
            kv_transfer_config=config,
            enable_prefix_caching=False,
            seed=0,
            **{"enforce_eager": True, **extra},
        )
        load_s = time.perf_counter() - started
        prefix = list(profile.prefix_ids)
        prompts = [TokensPrompt(prompt_token_ids=prefix + list(u["ids"])) for u in units]
        params = [
            SamplingParams(
                max_tokens=1,
                extra_args={"kv_transfer_params": {PARAMS_KEY: {"chunks": u["chunks"], "write_back": True}}},
            )
            for u in units
        ]
        computing = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=True)
        connector = get_kv_transfer_group()
        connector.flush()
        result.update(
            compute_s=time.perf_counter() - computing,
            start_s=load_s,
            stored=connector._saver.write_back.report.stored,
            dropped=connector._saver.write_back.report.dropped,
        )
    result["total_s"] = time.perf_counter() - started
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
