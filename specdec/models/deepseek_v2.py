"""DeepSeek-V2 / V2-Lite (``DeepseekV2ForCausalLM``): DeepSeek-V3's MLA (``models/deepseek_v3.py``:
the same latent cache, absorbed and expanded forms; rotary pairs always interleaved) with V2's
router: softmax scores, the top ``num_experts_per_tok`` (``topk_method`` "greedy"), or within the
``topk_group`` groups of highest maximum score (``"group_limited_greedy"``), times
``routed_scaling_factor``, not renormalised (as transformers computes it); no correction bias."""
from __future__ import annotations

import torch
from torch import nn

from specdec.layers.moe import Routing, router_logits
from specdec.models.deepseek_v3 import DeepseekV3ForCausalLM
from specdec.models.llama import _cfg


class DeepseekV2Router(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.method = _cfg(config, "topk_method", "greedy")
        if self.method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {self.method!r} is not supported (greedy, group_limited_greedy)")
        self.num_groups, self.topk_groups = _cfg(config, "n_group", 1), _cfg(config, "topk_group", 1)
        self.routed_scaling_factor = float(_cfg(config, "routed_scaling_factor", 1.0))
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Routing:
        scores = router_logits(x.float(), self.weight).softmax(dim=-1)  # [T, E], a row's the same in any batch
        if self.method == "group_limited_greedy":
            grouped = scores.view(-1, self.num_groups, self.num_experts // self.num_groups)
            best = torch.topk(grouped.max(dim=-1).values, self.topk_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            scores = scores.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return Routing(weights * self.routed_scaling_factor, ids)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    router_class = DeepseekV2Router
    rope_interleave = True

    def __init__(self, config, **kwargs):
        if _cfg(config, "mlp_bias", False):
            raise ValueError("DeepSeek-V2 with mlp_bias is not supported")
        super().__init__(config, **kwargs)
