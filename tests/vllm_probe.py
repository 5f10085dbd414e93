"""Run inside a Python that has vLLM (tests/test_vllm.py starts it): one vLLM engine with the
ragkv connector, prompts given as token ids, greedy first tokens and vLLM's own counts of the
tokens it did not compute. Prints one JSON object.

    python tests/vllm_probe.py MODEL_FOLDER STORE PROMPTS.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of paged KV on a CPU build


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model, store, prompts_file = sys.argv[1:4]
    prompts = json.loads(Path(prompts_file).read_text())
    config = KVTransferConfig(kv_connector="RagkvConnector", kv_connector_module_path="ragkv.integrations.vllm",
                              kv_role="kv_consumer", kv_connector_extra_config={"store": store})
    started = time.perf_counter()
    llm = LLM(model=model, dtype="float32", kv_transfer_config=config, enable_prefix_caching=False,
              max_model_len=2048, max_num_seqs=4, enforce_eager=True, seed=0)
    out = {"start_s": time.perf_counter() - started, "runs": [],
           "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    for name, ids, skip in prompts:
        extra = {"kv_transfer_params": {"ragkv": "skip"}} if skip else None
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, extra_args=extra)
        began = time.perf_counter()
        (result,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        completion = result.outputs[0]
        out["runs"].append({"name": name, "skip": skip, "num_prompt_tokens": len(ids),
                            "first_token": completion.token_ids[0], "num_cached_tokens": result.num_cached_tokens,
                            "logprobs": {str(k): v.logprob for k, v in completion.logprobs[0].items()},
                            "seconds": time.perf_counter() - began})
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
