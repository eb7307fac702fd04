"""Model shapes and the training loop for the bundled Llama models (HF `LlamaForCausalLM`)."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama model; `intermediate` is the SwiGLU hidden width."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tie: bool = True


@dataclass(frozen=True)
class TrainSpec:
    """Optimisation settings for one training run."""

    steps: int
    batch_size: int
    context: int
    lr: float
    warmup: int
    weight_decay: float = 0.1
    dropout: float = 0.0
    eval_every: int = 100
    distill_weight: float = 0.0  # 0: plain next-token loss; 1: only KL to the teacher's distribution


def param_count(spec: ModelSpec, vocab_size: int) -> int:
    """Parameters of a Llama model of this shape (a tied embedding counted once)."""
    head_dim = spec.hidden // spec.heads
    attn = 2 * spec.hidden * spec.hidden + 2 * spec.hidden * spec.kv_heads * head_dim
    mlp = 3 * spec.hidden * spec.intermediate
    per_layer = attn + mlp + 2 * spec.hidden
    embeddings = vocab_size * spec.hidden * (1 if spec.tie else 2)
    return embeddings + spec.layers * per_layer + spec.hidden


def fit_intermediate(spec: ModelSpec, vocab_size: int, budget: int, multiple: int = 32) -> ModelSpec:
    """The same shape with the widest SwiGLU layer (a multiple of `multiple`) within `budget` params."""
    rest = param_count(replace(spec, intermediate=0), vocab_size)
    width = (budget - rest) // (3 * spec.hidden * spec.layers) // multiple * multiple
    if width < multiple:
        raise SystemExit(f"{spec} leaves no room for an MLP within {budget} parameters at vocab {vocab_size}")
    return replace(spec, intermediate=width)


def first_fitting(specs: tuple[ModelSpec, ...], vocab_size: int, budget: int) -> ModelSpec:
    """The first shape whose embeddings leave room for an MLP within `budget`, refitted to it."""
    for spec in specs:
        rest = param_count(replace(spec, intermediate=0), vocab_size)
        if budget - rest >= 3 * spec.hidden * spec.layers * 64:
            return fit_intermediate(spec, vocab_size, budget)
    raise SystemExit(f"no draft shape fits {budget} parameters at vocab {vocab_size}")


def llama_config(spec: ModelSpec, vocab_size: int, eot_id: int, max_positions: int) -> LlamaConfig:
    """A standard HF LlamaConfig; `<|endoftext|>` is both BOS and EOS."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=spec.tie,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=None,
        rms_norm_eps=1e-5,
    )


def build_model(
    spec: ModelSpec, vocab_size: int, eot_id: int, max_positions: int, seed: int
) -> LlamaForCausalLM:
    """A freshly initialised model; the seed fixes its weights."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(spec, vocab_size, eot_id, max_positions))


def add_residual_dropout(model: LlamaForCausalLM, p: float) -> None:
    """Dropout on the embedding and on each attention and MLP output, active in train mode only.

    HF Llama has no residual dropout; forward hooks add it without changing any weight name.
    """
    if p <= 0:
        return

    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor | tuple) -> torch.Tensor | tuple:
        if not module.training:
            return output
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, True), *output[1:])
        return F.dropout(output, p, True)

    model.model.embed_tokens.register_forward_hook(hook)
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, spec: TrainSpec, device: str) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norm gains)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), fused=device == "cuda")


def sample_batch(
    data: torch.Tensor, batch: int, context: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the token stream: inputs [B, T] and next-token targets [B, T]."""
    starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=gen, device=data.device)
    idx = starts[:, None] + torch.arange(context + 1, device=data.device)
    windows = data[idx]
    return windows[:, :-1], windows[:, 1:]


def batch_loss(
    model: LlamaForCausalLM,
    x: torch.Tensor,
    y: torch.Tensor,
    teacher: LlamaForCausalLM | None,
    distill_weight: float,
) -> torch.Tensor:
    """Next-token cross-entropy, mixed with KL(teacher || model) when distilling."""
    # x, y: [B, T]; logits: [B, T, V]
    logits = model(input_ids=x).logits.float()
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    if teacher is None or distill_weight == 0:
        return ce
    with torch.no_grad():
        target = F.log_softmax(teacher(input_ids=x).logits.float(), dim=-1)
    kl = F.kl_div(F.log_softmax(logits, dim=-1), target, log_target=True, reduction="batchmean") / x.shape[1]
    return (1 - distill_weight) * ce + distill_weight * kl


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, windows: torch.Tensor, batch: int) -> float:
    """Mean next-token loss (nats) over fixed windows [N, T+1]; a cheap dev signal for early stopping."""
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        logits = model(input_ids=w[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    return total / count


def dev_windows(ids: torch.Tensor, context: int) -> torch.Tensor:
    """Non-overlapping windows [N, T+1] covering a held-out token stream."""
    n = (ids.numel() - 1) // context
    return torch.stack([ids[i * context : i * context + context + 1] for i in range(n)])


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    lr: float,
    autocast: torch.autocast,
    teacher: LlamaForCausalLM | None,
    distill_weight: float,
) -> torch.Tensor:
    """One optimiser step on one batch; returns the (detached) loss without syncing the device."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    with autocast:
        loss = batch_loss(model, *batch, teacher, distill_weight)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach()


def progress_line(record: dict) -> str:
    """One log line for an evaluation record."""
    train_loss = "     -" if record["train_loss"] is None else f"{record['train_loss']:.4f}"
    rate = record["tokens"] / max(record["seconds"], 1e-9)
    return (
        f"step {record['step']:5d}  train {train_loss}  dev {record['dev_loss']:.4f}  "
        f"{record['seconds']:6.1f}s  {rate:,.0f} tok/s"
    )


def train(
    model: LlamaForCausalLM,
    data: torch.Tensor,
    dev: torch.Tensor,
    spec: TrainSpec,
    device: str,
    seed: int,
    log: Callable[[str], None],
    teacher: LlamaForCausalLM | None = None,
    compile_model: bool = False,
) -> list[dict]:
    """Train in place, evaluating on `dev` windows; the model ends with its best-dev weights.

    Returns the loss history, one record per evaluation. The train loss is the mean
    training objective (dropout on; KL when fully distilling) since the previous record.
    """
    model.to(device).train()
    add_residual_dropout(model, spec.dropout)
    step_fn = torch.compile(model) if compile_model else model
    optimizer = make_optimizer(model, spec, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    # bf16 autocast on GPU; on CPU it is slower than float32, so it stays off there.
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda")
    history: list[dict] = []
    best_loss, best_state = math.inf, None
    running, since = torch.zeros((), device=device), 0
    start = time.perf_counter()
    for step in range(spec.steps + 1):
        if step % spec.eval_every == 0 or step == spec.steps:
            model.eval()
            with autocast:
                dev_loss = mean_loss(model, dev, spec.batch_size)
            model.train()
            history.append({
                "step": step,
                "tokens": step * spec.batch_size * spec.context,
                "train_loss": running.item() / since if since else None,
                "dev_loss": dev_loss,
                "seconds": round(time.perf_counter() - start, 1),
            })
            log(progress_line(history[-1]))
            running.zero_()
            since = 0
            if dev_loss < best_loss:
                best_loss, best_state = dev_loss, copy.deepcopy(model.state_dict())
        if step == spec.steps:
            break
        batch = sample_batch(data, spec.batch_size, spec.context, gen)
        lr = lr_at(step, spec)
        running += train_step(step_fn, optimizer, batch, lr, autocast, teacher, spec.distill_weight)
        since += 1
    model.load_state_dict(best_state)
    model.eval()
    return history


def describe_spec(spec: ModelSpec | TrainSpec) -> dict:
    """A spec as a plain dict for the results JSON."""
    return asdict(spec)
