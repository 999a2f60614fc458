"""Where a draft step's time goes and what bounds it: the profiler breakdown, copy bandwidth and
the bytes a step must read. The timings themselves come from the latency model (engine.latency).
"""

from __future__ import annotations

import torch

from layerskip.engine.latency import DraftStep, median_seconds
from layerskip.hf import adapters

PROJECTION_OPS = ("aten::mm", "aten::addmm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math")


@torch.inference_mode()
def draft_step_breakdown(step: DraftStep, repeats: int = 15) -> dict[str, float]:
    """Where one draft step's milliseconds go (CPU): the LM head, the kept projections, attention
    kernels, the other tensor ops (norms, rotary, residual adds, casts, cache writes), and the rest
    of the wall time (Python, module calls, op dispatch). Op times are torch.profiler self times."""
    from torch.profiler import ProfilerActivity, profile

    wall = median_seconds(step, step.device, repeats)
    hidden = step.hidden()
    head_seconds = median_seconds(lambda: step.head(hidden), step.device, repeats)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
    self_us: dict[str, float] = {}
    for event in prof.key_averages():
        self_us[event.key] = self_us.get(event.key, 0.0) + event.self_cpu_time_total
    total_ops = sum(self_us.values()) / repeats / 1e6
    projections = sum(self_us.get(op, 0.0) for op in PROJECTION_OPS) / repeats / 1e6
    attention_ops = sum(self_us.get(op, 0.0) for op in ATTENTION_OPS) / repeats / 1e6
    return {
        "total_ms": 1000 * wall,
        "head_ms": 1000 * head_seconds,
        "layer_projections_ms": 1000 * max(0.0, projections - head_seconds),
        "attention_kernels_ms": 1000 * attention_ops,
        "other_ops_ms": 1000 * max(0.0, total_ops - projections - attention_ops),
        "python_and_dispatch_ms": 1000 * max(0.0, wall - total_ops),
    }


def copy_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes per second a large copy moves on ``device`` (what it reads plus what it writes): the
    memory bandwidth a bandwidth-bound step can hope for."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), torch.device(device), repeats)
    return 2 * source.numel() * source.element_size() / seconds


def draft_bytes_read(step: DraftStep) -> int:
    """Bytes one draft step must read: the kept projections (the draft's copies, or the model's own
    weights), the head rows it scores in the draft's dtype, and the K/V of the kept attention
    layers (the context's positions each, the model's dtype). Norms, biases and the embedding row
    are left out: a rounding error next to these."""
    draft_model, model, attention = step.draft_model, step.draft_model.model, step.attention
    skipped = {(i, "attention") for i in attention} | {(i, "mlp") for i in step.mlp}
    weights = 0
    for index in range(adapters.num_layers(model)):
        for kind in ("attention", "mlp"):
            if (index, kind) in skipped:
                continue
            if (index, kind) in draft_model.projections:
                weights += sum(group.nbytes for _, group in draft_model.projections[(index, kind)])
            else:
                modules = adapters.sublayer_projections(model, index, kind)
                weights += sum(m.weight.numel() * m.weight.element_size() for m in modules)
    if draft_model.exit is not None:
        weights += sum(p.numel() * p.element_size() for p in draft_model.exit.module.parameters())
    head = adapters.lm_head(model).weight
    rows = head.shape[0] if step.head_rows is None else step.head_rows
    head_bytes = rows * head.shape[1] * torch.tensor([], dtype=draft_model.dtype).element_size()
    kv = 0
    config = model.config.get_text_config(decoder=True)
    windows = adapters.sliding_windows(model)
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    for index in range(adapters.num_layers(model)):
        if index not in attention:
            seen = step.length if windows[index] is None else min(step.length, windows[index])
            kv += 2 * kv_heads * head_dim * seen * element
    return weights + head_bytes + kv
