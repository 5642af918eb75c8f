"""One specdec configuration in its own process: ``python -m specdec.bench.peers.specdec_worker JOB.json``.

The job (written by ``specdec bench peers``) holds the model, the engine options, the prompts as
token ids and the sizes. Batch 1: each prompt alone, timed by ``driver.timed_generate`` (decode =
from the first token to the last, tokens after the first). Batch N: one ``generate`` of all
prompts, total output tokens over its wall time. The result is one ``PEER_RESULT {json}`` line.
"""
from __future__ import annotations

import json
import sys
import time

RESULT_PREFIX = "PEER_RESULT "


def run_job(job: dict) -> dict:
    from specdec import LLM
    from specdec.bench import driver

    options = dict(job["options"])
    t = time.perf_counter()
    llm = LLM(model=job["model"], num_threads=job["num_threads"], max_model_len=job["max_model_len"],
              max_num_seqs=max(job["batch_size"], 1), seed=0, **options)
    load_s = time.perf_counter() - t
    params = driver.greedy_params(job["output_len"])
    prompts = job["prompts"]
    driver.timed_generate(llm, prompts[:1], driver.greedy_params(job.get("warmup_tokens", 16)))  # untimed
    if job["batch_size"] == 1:
        runs = [driver.timed_generate(llm, [p], params) for p in prompts]
        per_prompt = [{"num_output_tokens": r.num_output_tokens, "num_decode_tokens": r.num_decode_tokens,
                       "prefill_s": r.prefill_s, "decode_s": r.decode_s} for r in runs]
        acceptance = _merge_acceptance(r.acceptance for r in runs)
        return {"per_prompt": per_prompt, "acceptance": acceptance, "load_s": load_s}
    before = dict(llm.get_metrics())
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall_s = time.perf_counter() - t
    after = llm.get_metrics()
    drafts = after["num_drafts"] - before.get("num_drafts", 0)
    drafted = after["num_draft_tokens"] - before.get("num_draft_tokens", 0)
    accepted = after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)
    return {"num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "wall_s": wall_s,
            "acceptance": _acceptance(drafts, drafted, accepted), "load_s": load_s}


def _merge_acceptance(counts) -> dict | None:
    from specdec.spec_decode.metrics import AcceptanceCounts

    total = AcceptanceCounts()
    for c in counts:
        total.merge(c)
    if not total.num_drafts:
        return None
    d = total.as_dict()
    return {"acceptance_rate": d.get("acceptance_rate"), "mean_acceptance_length": d.get("mean_acceptance_length")}


def _acceptance(drafts: int, drafted: int, accepted: int) -> dict | None:
    if not drafts:
        return None
    return {"acceptance_rate": accepted / drafted if drafted else None, "mean_acceptance_length": 1 + accepted / drafts}


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        job = json.load(f)
    print(RESULT_PREFIX + json.dumps(run_job(job)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
