"""One vLLM configuration in its own process, run by the python of vLLM's own venv:
``VENV/bin/python vllm_worker.py JOB.json``. Imports only the standard library and vllm (specdec is
not installed there).

Decode tokens/s is defined as in specdec's bench (``driver.timed_generate``): output tokens after
the first over the time from the first token to the last, read from vLLM's per-request stats
(``RequestOutput.metrics``: engine-core ``first_token_ts`` / ``last_token_ts``; on with
``disable_log_stats=False``). Batch N: one ``generate`` of all prompts, total output tokens over
its wall time. Acceptance comes from vLLM's own counters (``LLM.get_metrics``).
"""
from __future__ import annotations

import json
import sys
import time

RESULT_PREFIX = "PEER_RESULT "
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")


def counters(llm) -> dict:
    out = dict.fromkeys(COUNTERS, 0)
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - an older vLLM without the metrics reader
        return out
    for m in metrics:
        if m.name in out and hasattr(m, "value"):
            out[m.name] += m.value
    return out


def acceptance(before: dict, after: dict) -> dict | None:
    drafts, drafted, accepted = (after[k] - before[k] for k in COUNTERS)
    if not drafts:
        return None
    return {"acceptance_rate": accepted / drafted if drafted else None, "mean_acceptance_length": 1 + accepted / drafts}


def per_request(out) -> dict:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    return {"num_output_tokens": n, "num_decode_tokens": n - 1, "prefill_s": m.first_token_ts - m.scheduled_ts,
            "decode_s": m.last_token_ts - m.first_token_ts}


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    options = dict(job["options"])
    kwargs = dict(model=job["model"], dtype=options.pop("dtype", "bfloat16"), max_model_len=job["max_model_len"],
                  max_num_seqs=max(job["batch_size"], 1), seed=0, disable_log_stats=False)
    kwargs.update(options.pop("llm_kwargs", {}))
    kwargs.update(options)  # speculative_config, ...
    t = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t
    params = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=job.get("warmup_tokens", 16),
                                             ignore_eos=True), use_tqdm=False)
    before = counters(llm)
    if job["batch_size"] == 1:
        per_prompt = [per_request(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
        return {"per_prompt": per_prompt, "acceptance": acceptance(before, counters(llm)), "load_s": load_s,
                "vllm_version": _version()}
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - t
    return {"num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "wall_s": wall_s,
            "acceptance": acceptance(before, counters(llm)), "load_s": load_s, "vllm_version": _version()}


def _version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        job = json.load(f)
    print(RESULT_PREFIX + json.dumps(run_job(job)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
