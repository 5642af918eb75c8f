"""Quiet A/B of one speculative step shape: plain vs replay (acceptance 1.0) at K drafts on the
random 1.1B Llama, batch 1, 96 tokens; prints tokens/s, seconds per decode step and the breakdown.
Run: python scripts/replay_step_ab.py K   (the model: specdec bench make-model /tmp/llama1b)"""
import sys

from specdec import LLM
from specdec.bench import driver

k = int(sys.argv[1])
MODEL = sys.argv[2] if len(sys.argv) > 2 else "/tmp/llama1b"
base = LLM(MODEL, dtype="bfloat16")
params = driver.greedy_params(96)
prompts = driver.make_prompts(base, "text", 1, 128, seed=0)
driver.warmup(base)
refs = driver.timed_generate(base, prompts, params).token_ids
llm = LLM(MODEL, dtype="bfloat16", speculative_config={"method": "replay", "num_speculative_tokens": k, "acceptance": 1.0})
driver.register_references(llm, prompts, refs)
driver.warmup(llm)
for name, l in (("plain", base), ("spec", llm)):
    r = driver.timed_generate(l, prompts, params)
    print(name, r.decode_tokens_per_s, r.decode_step_s, r.decode_breakdown_s, r.num_decode_steps)
