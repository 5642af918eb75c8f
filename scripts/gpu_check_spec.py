"""The speculation phases of scripts/gpu_check.sh (it imports this file; not a command itself).

On the random-weight checkpoint the script saved, through specdec's own model runner:
- ``tree_steps``: a target step verifying a 24-node token tree (25 rows) and a K = 5 chain
  (6 rows) against a decode step, at batch 1 and 8 over 512-token contexts, eager and from
  graphs (the padded tree graph for the tree), with the graph's tree logits checked against
  the eager ones;
- ``tree_attention``: one layer's attention alone for those rows, the Triton kernel (tree rows
  in the kernel) beside the torch path;
- ``fp8_draft``: a draft decode step with bf16 weights against fp8 weights (Llama-3.2-1B shape
  for the 8B preset), with their top-1 agreement over a prompt;
- ``eagle_step``: an EAGLE head's draft step against the target's decode step (the c of the
  speedup bound).
On CPU (the dry run) the models use the torch attention path and no graphs.
"""
from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time

import torch

CONTEXT = 512
TREE_PARENTS = [-1] * 4 + [(i - 4) // 2 for i in range(4, 24)]  # 24 nodes: 4, 8, 12 at depths 1, 2, 3
TREE_ROWS = 1 + len(TREE_PARENTS)
CHAIN_ROWS = 6
BLOCK_SIZE = 16
BLOCKS_PER_REQUEST = -(-(CONTEXT + 2 * TREE_ROWS) // BLOCK_SIZE)


def backend_for(device):
    from specdec.layers.attention import TORCH_BACKEND

    if device.type != "cuda":  # the script runs kernels compiled, so CPU takes the torch path
        return TORCH_BACKEND
    from specdec.layers.attention_triton import TRITON_BACKEND

    return TRITON_BACKEND


def new_runner(model, batch_size, device):
    from specdec.worker.model_runner import ModelRunner

    return ModelRunner(model, batch_size * BLOCKS_PER_REQUEST, BLOCK_SIZE, device, torch.bfloat16)


def prefill(runner, batch_size, vocab, all_logits=False, hidden_size=None):
    """Fill a CONTEXT-token prompt per request; returns (block tables, logits)."""
    gen = torch.Generator().manual_seed(batch_size)
    tables = [list(range(r * BLOCKS_PER_REQUEST, (r + 1) * BLOCKS_PER_REQUEST)) for r in range(batch_size)]
    prompts = [torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist() for _ in range(batch_size)]
    rows = [list(range(CONTEXT)) if all_logits else [CONTEXT - 1]] * batch_size
    batch = runner.prepare(prompts, [0] * batch_size, tables, rows)
    if hidden_size is not None:  # an EAGLE head reads target features
        batch.features = torch.randn(batch_size * CONTEXT, hidden_size, generator=gen).to(runner.device, runner.dtype)
    return tables, runner.forward(batch)


def step(runner, tables, num_rows, parents=None, hidden_size=None):
    """One step over the prompts: num_rows rows per request, a token tree when parents are given."""
    from specdec.spec_decode.tree import ancestor_mask, depths

    n = len(tables)
    positions = masks = None
    if parents is not None:
        positions = [[CONTEXT] + [CONTEXT + d for d in depths(parents)]] * n
        masks = [(CONTEXT + 1, ancestor_mask(parents))] * n
    batch = runner.prepare([[7] * num_rows] * n, [CONTEXT] * n, tables, [list(range(num_rows))] * n, positions, masks)
    if hidden_size is not None:
        batch.features = torch.zeros(n * num_rows, hidden_size, dtype=runner.dtype, device=runner.device)
    return batch


def run_phases(R, state, device, preset, presets, phase, seconds_per_call, deadline):
    cuda = device.type == "cuda"
    iters = 20 if cuda else 3

    def timed(fn):
        return seconds_per_call(fn, iters=iters) * 1e3

    def have_time(name, need_s):
        if time.time() + need_s > deadline:
            R.setdefault("skipped", {})[name] = f"under {need_s}s left"
            return False
        return True

    def free():
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    free()  # the engine phase's KV cache

    @phase("tree_steps")
    def _():
        if not have_time("tree_steps", 90):
            return
        from specdec.models.loader import load_config, load_model

        backend = backend_for(device)
        cfg = load_config(state["ckpt"])
        model = state["spec_target"] = load_model(state["ckpt"], torch.bfloat16, device, backend, cfg)
        out = R["tree_steps"] = {"attention_backend": backend.name, "tree_nodes": len(TREE_PARENTS)}
        kinds = {"decode": (1, None), "chain_k5": (CHAIN_ROWS, None), "tree_24": (TREE_ROWS, TREE_PARENTS)}
        for batch_size in (1, 8):
            runner = new_runner(model, batch_size, device)
            tables, _ = prefill(runner, batch_size, cfg.vocab_size)
            # forward costs on prepared batches (the masks packed once, as every layer of a step
            # shares them); the host's preparation of a step is timed on its own
            res = out[f"batch{batch_size}"] = {"eager_ms": {}, "graph_ms": {}, "prepare_ms": {}}
            batches = {kind: step(runner, tables, rows, parents) for kind, (rows, parents) in kinds.items()}
            for kind, (rows, parents) in kinds.items():
                res["prepare_ms"][kind] = timed(lambda: step(runner, tables, rows, parents))
                res["eager_ms"][kind] = timed(lambda: runner.forward(batches[kind]))
            tree_eager = runner.forward(batches["tree_24"]).clone()
            if cuda:
                runner.enable_graphs([batch_size], [1, CHAIN_ROWS], BLOCKS_PER_REQUEST)
                runner.enable_tree_graphs([batch_size], TREE_ROWS, len(TREE_PARENTS), BLOCKS_PER_REQUEST)
                for kind in kinds:
                    if runner._graph_for(batches[kind]) is None:
                        R["errors"][f"tree_steps_graph_{kind}"] = "no graph served this step"
                    res["graph_ms"][kind] = timed(lambda: runner.forward(batches[kind]))
                tree_graph = runner.forward(batches["tree_24"])
                res["tree_graph_vs_eager_max_abs"] = (tree_graph - tree_eager).abs().max().item()
                res["tree_logits_max_abs"] = tree_eager.abs().max().item()
            best = res["graph_ms"] or res["eager_ms"]
            res["tree_vs_decode"] = best["tree_24"] / best["decode"]
            res["chain_vs_decode"] = best["chain_k5"] / best["decode"]
            del runner
            free()

    @phase("tree_attention")
    def _():
        if not cuda:
            R["tree_attention"] = {"skipped": "needs the compiled kernel (GPU)"}
            return
        from specdec.layers.attention import AttentionMetadata, paged_attention_torch
        from specdec.layers.attention_triton import attend_triton as paged_attention_triton
        from specdec.spec_decode.tree import ancestor_mask

        cfg = presets[preset]
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        head_dim, batch_size = cfg["hidden_size"] // heads, 8
        seq_len = CONTEXT + TREE_ROWS
        kv_cache = torch.randn(2, batch_size * BLOCKS_PER_REQUEST, BLOCK_SIZE, kv_heads, head_dim,
                               dtype=torch.bfloat16, device=device)
        tables = torch.arange(batch_size * BLOCKS_PER_REQUEST, device=device).view(batch_size, -1)

        def meta(rows, tree):
            qsl = [r * rows for r in range(batch_size + 1)]
            seq = [CONTEXT + rows] * batch_size
            masks = [(CONTEXT + 1, ancestor_mask(TREE_PARENTS).to(device))] * batch_size if tree else None
            return AttentionMetadata(torch.tensor(qsl, device=device), torch.tensor(seq, device=device), tables,
                                     torch.zeros(qsl[-1], dtype=torch.int64, device=device), qsl, seq, BLOCK_SIZE,
                                     masks)

        scale = head_dim ** -0.5
        decode, tree = meta(1, False), meta(TREE_ROWS, True)
        q1 = torch.randn(batch_size, heads, head_dim, dtype=torch.bfloat16, device=device)
        qt = torch.randn(batch_size * TREE_ROWS, heads, head_dim, dtype=torch.bfloat16, device=device)
        res = R["tree_attention"] = {"batch": batch_size, "context": CONTEXT, "seq_len": seq_len}
        res["decode_us"] = timed(lambda: paged_attention_triton(q1, kv_cache, decode, scale)) * 1e3
        res["tree_24_triton_us"] = timed(lambda: paged_attention_triton(qt, kv_cache, tree, scale)) * 1e3
        res["tree_24_torch_us"] = timed(lambda: paged_attention_torch(qt, kv_cache, tree, scale)) * 1e3
        got = paged_attention_triton(qt, kv_cache, tree, scale).float()
        want = paged_attention_torch(qt, kv_cache, tree, scale).float()
        res["triton_vs_torch_rel_err"] = ((got - want).norm() / want.norm()).item()

    @phase("fp8_draft")
    def _():
        if not have_time("fp8_draft", 60):
            return
        import transformers

        from specdec.layers.fp8 import Fp8Linear
        from specdec.layers.quantization import prepare_for_inference
        from specdec.models.loader import load_config, load_model

        draft_preset = {"llama3-8b": "llama3-1b"}.get(preset, preset)
        path = tempfile.mkdtemp(prefix="specdec_gpu_check_draft_", dir=os.environ.get("GPU_CHECK_TMP"))
        res = R["fp8_draft"] = {"draft_preset": draft_preset}
        try:
            hf_cfg = transformers.LlamaConfig(**{"max_position_embeddings": 8192, "tie_word_embeddings": False,
                                                 **presets[draft_preset]})
            torch.manual_seed(1)
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device(device):  # initialised on the GPU, as the target is
                    hf = transformers.LlamaForCausalLM(hf_cfg)
            finally:
                torch.set_default_dtype(default_dtype)
            hf.config.dtype = "bfloat16"
            hf.save_pretrained(path)
            del hf
            backend, cfg = backend_for(device), load_config(path)
            logits = {}
            for name, quant in (("bf16", None), ("fp8", "fp8")):
                model = prepare_for_inference(load_model(path, torch.bfloat16, device, backend, cfg), quant, device)
                runner = new_runner(model, 1, device)
                tables, logits[name] = prefill(runner, 1, cfg.vocab_size, all_logits=True)
                decode = step(runner, tables, 1)
                res[f"{name}_eager_ms"] = timed(lambda: runner.forward(decode))
                fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
                if fp8:
                    res["fp8_dtype"], res["scaled_mm"] = str(fp8[0].fp8_dtype), fp8[0].use_scaled_mm
                if cuda:
                    runner.enable_graphs([1], [1], BLOCKS_PER_REQUEST)
                    res[f"{name}_graph_ms"] = timed(lambda: runner.forward(decode))
                if fp8 and fp8[0].use_scaled_mm:  # the same weights through the dequantise path
                    for m in fp8:
                        m.use_scaled_mm = False
                    runner.graphs = {}
                    res["fp8_dequantise_eager_ms"] = timed(lambda: runner.forward(decode))
                del runner, model
                free()
            key = "graph_ms" if cuda else "eager_ms"
            res["fp8_vs_bf16"] = res[f"fp8_{key}"] / res[f"bf16_{key}"]
            res["top1_agreement"] = (logits["fp8"].argmax(-1) == logits["bf16"].argmax(-1)).float().mean().item()
        finally:
            shutil.rmtree(path, ignore_errors=True)

    @phase("eagle_step")
    def _():
        if not have_time("eagle_step", 30):
            return
        from specdec.models.eagle import EagleHead, head_config

        target = state["spec_target"]
        with torch.device(device):
            head = EagleHead(head_config(target.config), backend_for(device)).to(torch.bfloat16).eval()
        head.rotary.reset_tables()  # the cos / sin tables stay float32
        head.attach(target)
        hidden = target.config.hidden_size
        runner = new_runner(head, 1, device)
        tables, _ = prefill(runner, 1, target.config.vocab_size, hidden_size=hidden)
        draft = step(runner, tables, 1, hidden_size=hidden)
        res = R["eagle_step"] = {"eager_ms": timed(lambda: runner.forward(draft))}
        target_steps = R.get("tree_steps", {}).get("batch1", {})
        for mode in ("eager_ms", "graph_ms"):
            if target_steps.get(mode, {}).get("decode"):
                res[f"vs_target_decode_{mode[:-3]}"] = res["eager_ms"] / target_steps[mode]["decode"]
        del runner, head
        state.pop("spec_target", None)
        free()


def report_rows(R) -> list[tuple[str, str]]:
    """The summary table of a gpu_check.json (in-process or loaded: row keys may be ints or strings)."""
    def f(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    def at(table, row):
        return table.get(row, table.get(str(row)))

    kt, eng, vc = R.get("kernel_tests", {}), R.get("engine", {}), R.get("verify_cost_vs_decode", {})
    rows = [
        ("kernel tests (device)", f"{kt.get('passed', 0)} passed, {kt.get('failed', 0)} failed, "
                                  f"{kt.get('skipped', 0)} skipped" if kt else "not run"),
        ("HBM bandwidth (copy)", f"{f(R.get('hbm_bandwidth_gbs'), '.0f')} GB/s"),
        (f"model ({R.get('preset')})", f"{f(R.get('model', {}).get('params_b'), '.2f')} B params, "
                                       f"{f(R.get('model', {}).get('weight_gb'), '.1f')} GB bf16"),
        ("decode roofline, batch 1", f"{f(R.get('roofline_decode_tok_s'))} tok/s"),
        ("HF forward 1 row", f"{f(at(R.get('hf_forward_ms', {}), 1), '.2f')} ms "
                             f"({at(R.get('hf_forward_mode', {}), 1) or '-'}), "
                             f"{f(R.get('hf_decode_roofline_fraction'), '.0%')} of roofline"),
        ("verify cost K+1=2..9 / 1 row", " ".join(f(at(vc, r), ".2f") for r in range(2, 10))),
        ("HF generate, batch 1", f"{f(R.get('hf_generate_tok_s'))} tok/s"),
        ("specdec decode, batch 1", f"{f(eng.get('decode_tok_s'))} tok/s, "
                                    f"{f(eng.get('decode_roofline_fraction'), '.0%')} of roofline"),
        ("specdec replay a=0.8 K=5", f"{f(eng.get('replay_tok_s'))} tok/s, speedup {f(eng.get('speedup'), '.2f')}x, "
                                     f"efficiency {f(eng.get('system_efficiency'), '.0%')} of bound "
                                     f"{f(eng.get('bound_tokens_per_step'), '.2f')}, mean acceptance length "
                                     f"{f(eng.get('metrics', {}).get('mean_acceptance_length'), '.2f')}"),
        ("specdec step ms spec / plain", f"{f(eng.get('spec_ms_per_step'), '.2f')} / "
                                         f"{f(eng.get('plain_ms_per_step'), '.2f')}, {eng.get('spec_drafts', '-')} of "
                                         f"{eng.get('spec_steps', '-')} spec steps drafted, warm plain runs agree: "
                                         f"{eng.get('first_plain_equals_second', '-')}"),
    ]
    if eng.get("skipped"):
        rows = rows[:-3] + [("specdec engine", eng["skipped"])]
    return rows + summary_rows(R)


def summary_rows(R) -> list[tuple[str, str]]:
    def f(value, spec=".2f"):
        return "-" if value is None else format(value, spec)

    ts, ta, fp, ea = (R.get(k, {}) for k in ("tree_steps", "tree_attention", "fp8_draft", "eagle_step"))
    b1, b8 = ts.get("batch1", {}), ts.get("batch8", {})
    mode = "graph" if b1.get("graph_ms") else "eager"
    return [
        ("tree step 24 nodes / decode", f"b1 {f(b1.get('tree_vs_decode'))}x, b8 {f(b8.get('tree_vs_decode'))}x "
                                        f"({mode}); chain K=5 b1 {f(b1.get('chain_vs_decode'))}x"),
        ("attention tree24 b8 (us)", f"triton {f(ta.get('tree_24_triton_us'), '.1f')}, torch "
                                     f"{f(ta.get('tree_24_torch_us'), '.1f')}, decode {f(ta.get('decode_us'), '.1f')}"
         if "decode_us" in ta else ta.get("skipped", "not run")),
        (f"draft step fp8 / bf16 ({fp.get('draft_preset', '-')})",
         f"{f(fp.get('fp8_vs_bf16'))}x, top-1 agreement {f(fp.get('top1_agreement'), '.1%')}, "
         f"{fp.get('fp8_dtype', '-')} scaled_mm={fp.get('scaled_mm', '-')}"),
        ("EAGLE head step / target", f"{f(ea.get('eager_ms'))} ms eager = {f(ea.get('vs_target_decode_graph'))}x "
                                     f"graph decode, {f(ea.get('vs_target_decode_eager'))}x eager decode"),
    ]
